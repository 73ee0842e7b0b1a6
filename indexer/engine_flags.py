"""Engines given on the command line: ``--engine`` and ``--engine-url``'s fields.

A flag's ``FIELD=VALUE`` items are :class:`~indexer.engine_registry.EngineSpec` fields
written as text; the rules for turning them into a spec (what ``null`` means
for a field that may not be None) live here once for both flags.
"""

from __future__ import annotations

import typing

import msgspec

from indexer.engine_registry import EngineSpec


def parse_engine_flag(text: str) -> EngineSpec:
    """An engine from ``NAME=ENDPOINT[,FIELD=VALUE...]``, the ``--engine`` flag.

    Fields are :class:`EngineSpec`'s, values as in a config file, e.g.
    ``a=tcp://10.0.0.5:5557,replay_endpoint=tcp://10.0.0.5:5558,dp_ranks=2``.
    ``null`` is None for a field that may be None (``hash_seed=null``) and
    the default for one that may not (``model=null`` is ``""``): a flag has
    no other way to say "none", and the string "null" as a seed or model
    would make every tokens query match nothing.
    Raises ValueError saying what is wrong.
    """
    head, *rest = text.split(",")
    name, sep, endpoint = head.partition("=")
    if not sep:
        raise ValueError(f"--engine {text!r}: expected NAME=ENDPOINT[,FIELD=VALUE...]")
    # ``NAME=,events=false,...``: an engine without events has no endpoint
    fields = {"name": name, "endpoint": endpoint or None}
    fields |= parse_flag_fields(rest, f"--engine {text!r}")
    try:
        return msgspec.convert(fields, EngineSpec, strict=False)
    except msgspec.ValidationError as e:
        raise ValueError(f"--engine {text!r}: {e}") from None


def parse_flag_fields(items: list[str], flag: str) -> dict[str, str | None]:
    """A flag's ``FIELD=VALUE`` items as EngineSpec fields (text, converted by the
    caller), ``null`` as :func:`parse_engine_flag` says. ``flag`` names it in errors."""
    pairs = [item.partition("=") for item in items if item]
    if not all(eq for _, eq, _ in pairs):
        raise ValueError(f"{flag}: expected FIELD=VALUE after each comma")
    fields: dict[str, str | None] = {}
    for key, _, value in pairs:
        key = key.strip()
        if value != "null" or key not in _SPEC_FIELDS:
            fields[key] = value
        elif nullable(key):
            fields[key] = None
        else:
            fields.pop(key, None)
    return fields


def nullable(field: str) -> bool:
    """Whether an EngineSpec field may be None (for the others, None means the default)."""
    return type(None) in typing.get_args(_SPEC_FIELDS[field].type)


_SPEC_FIELDS = {f.name: f for f in msgspec.structs.fields(EngineSpec)}
