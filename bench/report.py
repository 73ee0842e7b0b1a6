"""The benchmark report: one row per figure, with the baseline measured in the same run.

Every figure that has a baseline carries the ratio ``value / baseline`` and,
where the issue sets one, the goal the ratio must meet. Ratios are what to
compare across machines and runs; absolute numbers depend on a noisy,
shared 2-core machine. The same rows are written as Markdown (for people)
and JSON (for tools), next to the plots.
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Goal:
    """``ratio >= bound`` (``at_least``) or ``ratio <= bound``."""

    bound: float
    at_least: bool = True

    def met(self, ratio: float) -> bool:
        return ratio >= self.bound if self.at_least else ratio <= self.bound

    def __str__(self) -> str:
        return f"{'>=' if self.at_least else '<='} {self.bound:g}"


@dataclass(frozen=True, slots=True)
class Figure:
    section: str
    name: str
    value: float
    unit: str
    baseline: str | None = None
    baseline_value: float | None = None
    goal: Goal | None = None
    note: str = ""

    @property
    def ratio(self) -> float | None:
        if self.baseline_value in (None, 0):
            return None
        return self.value / self.baseline_value

    def as_dict(self) -> dict:
        out = asdict(self)
        out["goal"] = str(self.goal) if self.goal else None
        out["ratio"] = self.ratio
        out["met"] = self.goal.met(self.ratio) if self.goal and self.ratio is not None else None
        return out


@dataclass
class Report:
    """Figures, per-section details (raw numbers behind them) and plot files."""

    mode: str
    figures: list[Figure] = field(default_factory=list)
    details: dict[str, object] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    plots: list[str] = field(default_factory=list)

    def add(self, *figures: Figure) -> None:
        self.figures.extend(figures)

    def write(self, out: Path) -> tuple[Path, Path]:
        out.mkdir(parents=True, exist_ok=True)
        data = {
            "mode": self.mode,
            "when": time.strftime("%Y-%m-%d %H:%M:%S"),
            "machine": {"python": platform.python_version(), "cpu": platform.processor()},
            "figures": [f.as_dict() for f in self.figures],
            "details": self.details,
            "notes": self.notes,
            "plots": self.plots,
        }
        json_path, md_path = out / "report.json", out / "report.md"
        json_path.write_text(json.dumps(data, indent=1, default=str) + "\n")
        md_path.write_text(self.markdown())
        return md_path, json_path

    def markdown(self) -> str:
        lines = [
            f"# kvindex benchmarks ({self.mode} run)",
            "",
            "| # | figure | value | baseline (same run) | baseline value | ratio | goal | met |",
            "| --- | --- | ---: | --- | ---: | ---: | --- | --- |",
        ]
        for f in self.figures:
            ratio = f.ratio
            met = "" if f.goal is None or ratio is None else ("yes" if f.goal.met(ratio) else "NO")
            lines.append(
                f"| {f.section} | {f.name} | {_num(f.value)} {f.unit} | {f.baseline or ''} | "
                f"{_num(f.baseline_value)} | {_num(ratio)} | {f.goal or ''} | {met} |"
            )
        lines += ["", *(f"- {n}" for n in self.notes)] if self.notes else []
        lines += ["", *(f"![{p}]({p})" for p in self.plots)] if self.plots else []
        return "\n".join(lines) + "\n"


def _num(x: float | None) -> str:
    if x is None:
        return ""
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    return f"{x:.3g}"
