"""What a scenario hands to the report: figures, goals met or missed with evidence, and the
time series the chart draws. Kept as JSON per scenario, so scenarios run apart still make one
report."""

from __future__ import annotations

import datetime
import json
import os
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Goal:
    """One target of the issue, and what was measured against it."""

    name: str
    target: str
    value: str
    met: bool | None  # None: could not be measured (evidence says why)
    evidence: str = ""


@dataclass
class ScenarioResult:
    """Everything one scenario run found."""

    name: str
    command: str = ""
    started: str = ""
    finished: str = ""
    quick: bool = False
    settings: dict[str, Any] = field(default_factory=dict)
    figures: list[tuple[str, str]] = field(default_factory=list)
    goals: list[Goal] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    series: dict[str, Any] = field(default_factory=dict)
    machine: dict[str, Any] = field(default_factory=dict)

    def figure(self, label: str, value: object) -> None:
        self.figures.append((label, str(value)))

    def goal(self, name: str, target: str, value: str, met: bool | None,
             evidence: str = "") -> Goal:
        found = Goal(name, target, value, met, evidence)
        self.goals.append(found)
        return found

    @property
    def passed(self) -> bool:
        """No goal missed (goals that could not be measured do not count as missed)."""
        return all(goal.met is not False for goal in self.goals)

    def save(self, directory: Path) -> Path:
        """Write the result as JSON into directory (bench/results/load for the report)."""
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{self.name}{'-quick' if self.quick else ''}.json"
        path.write_text(json.dumps(asdict(self), indent=1, default=str))
        return path

    @classmethod
    def load(cls, path: Path) -> ScenarioResult:
        raw = json.loads(path.read_text())
        raw["goals"] = [Goal(**goal) for goal in raw.get("goals", [])]
        raw["figures"] = [tuple(row) for row in raw.get("figures", [])]
        return cls(**raw)


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def machine() -> dict[str, Any]:
    """The host the figures come from."""
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        memory = int(Path("/proc/meminfo").read_text().split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        memory = 0
    return {"cpus": os.cpu_count(), "cpu": cpu, "memory_gib": round(memory / 2**30, 1),
            "kernel": platform.release(), "python": platform.python_version(),
            "load_average": [round(x, 2) for x in os.getloadavg()]}


def fmt_ms(seconds: float) -> str:
    return "n/a" if seconds != seconds else f"{seconds * 1000:.0f} ms"


def fmt_mib(size: float) -> str:
    return f"{size / 2**20:.1f} MiB"
