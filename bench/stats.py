"""Repeated measurements and the two figures reported for each: median and the slow end."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Sample:
    """Repeated measurements of one quantity, in one unit."""

    unit: str  # "s", "bytes", "MB/s", "calls/s"
    values: list[float] = field(default_factory=list)
    higher_is_better: bool = False  # rates: the slow end is the low end

    def add(self, value: float) -> None:
        """Record one measurement."""
        self.values.append(value)

    @property
    def median(self) -> float:
        """The middle measurement."""
        return statistics.median(self.values)

    @property
    def p90(self) -> float:
        """The slow end: the 90th percentile of a time, the 10th of a rate."""
        if len(self.values) < 2:
            return self.values[0]
        deciles = statistics.quantiles(self.values, n=10, method="inclusive")
        return deciles[0] if self.higher_is_better else deciles[-1]

    def __len__(self) -> int:
        return len(self.values)


def publish(text: str, out: Path) -> int:
    """Print a bench's report and keep it in `out` (bench/results/); the exit status, 0."""
    print(text)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return 0
