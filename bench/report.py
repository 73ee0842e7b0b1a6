"""The benchmark report: one row per figure, with the baseline measured in the same run.

Every figure that has a baseline carries the ratio ``value / baseline`` and,
where the issue sets one, the goal the ratio must meet. Ratios are what to
compare across machines and runs; absolute numbers depend on a noisy,
shared 2-core machine. The same rows are written as Markdown (for people)
and JSON (for tools), next to the plots.

An issue's table (:class:`Table`) opens the report: each of its rows picks
the figures that measure it as they are added, so the table is built from
what this run measured, and a row whose item did not run says so.
"""

from __future__ import annotations

import json
import platform
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Goal:
    """``ratio >= bound`` (``at_least``) or ``ratio <= bound``."""

    bound: float
    at_least: bool = True

    def met(self, ratio: float) -> bool:
        return ratio >= self.bound if self.at_least else ratio <= self.bound

    def to_goal(self, ratio: float) -> float:
        """How far the ratio is on the way to the goal: 1 is exactly on it, above 1 is met;
        one scale for goals of both directions (plots put them side by side)."""
        if not self.at_least:
            return self.bound / ratio if ratio else float("inf")
        return ratio / self.bound

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
    #: The key of the issue-table row this figure measures (set by :meth:`Report.add`).
    row: str = ""

    @property
    def ratio(self) -> float | None:
        if self.baseline_value in (None, 0):
            return None
        return self.value / self.baseline_value

    @property
    def met(self) -> bool | None:
        ratio = self.ratio
        return None if self.goal is None or ratio is None else self.goal.met(ratio)

    def as_dict(self) -> dict:
        out = asdict(self)
        ratio = self.ratio
        out["goal"] = str(self.goal) if self.goal else None
        out["ratio"] = ratio
        out["met"] = self.met
        out["to_goal"] = self.goal.to_goal(ratio) if self.goal and ratio is not None else None
        return out


@dataclass(frozen=True, slots=True)
class Row:
    """One row of an issue's table: its words, the items that measure it, which figures."""

    key: str
    words: str
    items: tuple[str, ...]
    picks: Callable[[Figure], bool]


@dataclass(frozen=True, slots=True)
class Table:
    title: str
    rows: tuple[Row, ...]

    def row_of(self, figure: Figure) -> str:
        return next((r.key for r in self.rows if r.picks(figure)), "")


@dataclass
class Report:
    """Figures, per-section details (raw numbers behind them) and plot files."""

    mode: str
    table: Table | None = None
    figures: list[Figure] = field(default_factory=list)
    details: dict[str, object] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    plots: list[str] = field(default_factory=list)
    #: Items started in this run, and those of them that failed.
    ran: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)

    def add(self, *figures: Figure) -> None:
        for f in figures:
            self.figures.append(replace(f, row=self.table.row_of(f)) if self.table else f)

    def as_dict(self) -> dict:
        return {
            "mode": self.mode,
            "when": time.strftime("%Y-%m-%d %H:%M:%S"),
            "machine": {"python": platform.python_version(), "cpu": platform.processor()},
            "table": self.table_lines(),
            "figures": [f.as_dict() for f in self.figures],
            "details": self.details,
            "notes": self.notes,
            "plots": self.plots,
        }

    def write(self, out: Path) -> tuple[Path, Path]:
        out.mkdir(parents=True, exist_ok=True)
        json_path, md_path = out / "report.json", out / "report.md"
        json_path.write_text(json.dumps(self.as_dict(), indent=1, default=str) + "\n")
        md_path.write_text(self.markdown())
        return md_path, json_path

    def markdown(self) -> str:
        lines = [f"# kvindex benchmarks ({self.mode} run)", ""]
        if self.table:
            lines += [f"## {self.table.title}", "", *self.table_lines(), "", "## Every figure", ""]
        lines += [
            "| # | figure | value | baseline (same run) | baseline value | ratio | goal | met |",
            "| --- | --- | ---: | --- | ---: | ---: | --- | --- |",
        ]
        for f in self.figures:
            met = {None: "", True: "yes", False: "NO"}[f.met]
            lines.append(
                f"| {f.section} | {f.name} | {_num(f.value)} {f.unit} | {f.baseline or ''} | "
                f"{_num(f.baseline_value)} | {_num(f.ratio)} | {f.goal or ''} | {met} |"
            )
        lines += ["", *(f"- {n}" for n in self.notes)] if self.notes else []
        lines += ["", *(f"![{p}]({p})" for p in self.plots)] if self.plots else []
        return "\n".join(lines) + "\n"

    def table_lines(self) -> list[str]:
        """The issue's table as Markdown lines: one per row, empty without a table."""
        if self.table is None:
            return []
        lines = [
            "| row | now | baseline (same run) | ratio | goal | met | measured by |",
            "| --- | ---: | --- | ---: | --- | --- | --- |",
        ]
        return lines + [self._row_line(r) for r in self.table.rows]

    def _row_line(self, row: Row) -> str:
        figures = [f for f in self.figures if f.row == row.key]
        command = f"`python -m bench{' --quick' if self.mode == 'quick' else ''} --only "
        by = f"item {' '.join(row.items)}: {command}{' '.join(row.items)}`" if row.items else ""
        if not figures:
            return f"| {row.words} | {self._absent(row)} | | | | | {by} |"
        labels = distinct_parts([f.name for f in figures])
        first = figures[0]
        goals = " / ".join(dict.fromkeys(str(f.goal) for f in figures if f.goal))
        return (
            f"| {row.words} | {_joined(labels, [f.value for f in figures])} {first.unit} | "
            f"{first.baseline or ''}: {_joined(labels, [f.baseline_value for f in figures])} | "
            f"{_joined(labels, [f.ratio for f in figures])} | {goals} | {_met(figures)} | {by} |"
        )

    def _absent(self, row: Row) -> str:
        if any(item in self.failed for item in row.items):
            return "failed (see notes)"
        if not any(item in self.ran for item in row.items):
            return "not run"
        return "not measured (its item ran without this figure)"


def distinct_parts(names: Sequence[str]) -> list[str]:
    """What tells the names apart: each name less the words all of them start and end with
    (``64-block chain p50`` and ``512-block chain p50`` give ``64`` and ``512``)."""
    if len(names) < 2:
        return [""] * len(names)
    words = [re.split(r"(\W+)", n) for n in names]
    head = 0
    while all(len(w) > head and w[head] == words[0][head] for w in words):
        head += 1
    tail = 0
    while all(len(w) - head > tail and w[-1 - tail] == words[0][-1 - tail] for w in words):
        tail += 1
    return ["".join(w[head : len(w) - tail]) for w in words]


def _joined(labels: Sequence[str], values: Sequence[float | None]) -> str:
    pairs = zip(labels, values, strict=True)
    return " / ".join(f"{label}: {_num(v)}" if label else _num(v) for label, v in pairs)


def _met(figures: Sequence[Figure]) -> str:
    verdicts = [f.met for f in figures]
    if None in verdicts:
        return "no goal or baseline"
    if all(verdicts):
        return "met"
    if len(verdicts) == 1 or not any(verdicts):
        return "**NOT met**"
    return f"**NOT met** ({sum(verdicts)} of {len(verdicts)} met)"


def _num(x: float | None) -> str:
    if x is None:
        return ""
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    return f"{x:.3g}"
