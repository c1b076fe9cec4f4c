"""Summarise a list of numbers: the stats come back as the result, the logs stay logs.

    sandbox-kernel run examples/summarize.py --inputs @examples/summarize.json
"""

import statistics
import sys


def main(numbers: list, label: str = "numbers") -> dict:
    """Count, total, mean, median, smallest and largest of `numbers`."""
    print(f"summarising {len(numbers)} {label}")
    if not numbers:
        raise ValueError("numbers is empty: give at least one number")
    mean = statistics.fmean(numbers)
    # Diagnostics go to stderr; neither stream can end up in the result.
    print(f"mean of {label} is {mean:g}", file=sys.stderr)
    return {
        "label": label,
        "count": len(numbers),
        "total": sum(numbers),
        "mean": mean,
        "median": statistics.median(numbers),
        "min": min(numbers),
        "max": max(numbers),
    }
