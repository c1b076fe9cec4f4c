"""Charts drawn under matplotlib's Agg backend are shown all the same, as PNG displays.

Models often write `matplotlib.use('Agg')` and then `plt.show()`: under Agg, show() only warns
that the canvas "is non-interactive, and thus cannot be shown", and the chart is lost. The
kernel's backend is matplotlib-inline, which shows a cell's open figures when the cell ends; a
cell that switched to Agg gets the same: its figures still open are sent as PNG displays (as the
inline backend renders them) and closed, and the warning, now untrue, is not shown.
"""

from __future__ import annotations

import io
import sys
import warnings
from typing import Any

NOT_SHOWN = "FigureCanvasAgg is non-interactive, and thus cannot be shown"


def show_agg_figures() -> None:
    """After a cell: display and close the figures left open under the Agg backend."""
    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is None or str(pyplot.get_backend()).lower() != "agg":
        return
    from IPython.display import Image, display

    for number in pyplot.get_fignums():
        buffer = io.BytesIO()
        pyplot.figure(number).savefig(buffer, format="png", bbox_inches="tight")
        display(Image(data=buffer.getvalue(), format="png"))
    pyplot.close("all")


def load_ipython_extension(shell: Any) -> None:
    """Show Agg figures after each execution (main() calls trigger it after main too)."""
    shell.events.register("post_execute", show_agg_figures)
    warnings.filterwarnings("ignore", message=NOT_SHOWN, category=UserWarning)
