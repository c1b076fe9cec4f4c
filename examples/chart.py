"""Draw a bar chart of monthly values and return summary numbers alongside it.

    sandbox-kernel run examples/chart.py --inputs @examples/chart.json --save-displays out/
"""

import matplotlib.pyplot as plt


def main(values: list, labels: list | None = None, title: str = "Values") -> dict:
    """One bar per value; the chart arrives as an image/png display, the numbers as the result."""
    labels = labels or [str(number) for number in range(1, len(values) + 1)]
    print(f"drawing {len(values)} bars")
    _, ax = plt.subplots(figsize=(6, 3), dpi=80)
    ax.bar(labels, values, color="tab:blue")
    ax.set_title(title)
    ax.set_ylabel("value")
    best = max(range(len(values)), key=values.__getitem__)
    ax.bar([labels[best]], [values[best]], color="tab:orange")  # the best month stands out
    plt.show()
    return {
        "title": title,
        "bars": len(values),
        "total": sum(values),
        "best": {"label": labels[best], "value": values[best]},
    }
