"""Rich outputs under the sandbox: figures, IPython.display types, DataFrames, quiet font set-up."""

import base64
import io

import matplotlib.image
import pytest

from tests.helpers import ok

TWO_FIGURES = """
import matplotlib.pyplot as plt
def _solid(colour, inches):
    fig = plt.figure(figsize=(inches, 1), dpi=50, facecolor=colour)
    fig.add_axes([0, 0, 1, 1]).set_axis_off()
    return fig
"""


def centre_colour(display):
    """The RGB colour at the centre of a display's PNG, decoded in the test process."""
    pixels = matplotlib.image.imread(io.BytesIO(base64.b64decode(display["image/png"])))
    height, width = pixels.shape[:2]
    return tuple(float(channel) for channel in pixels[height // 2, width // 2, :3])


@pytest.mark.parametrize("draw, inputs", [
    ("_solid('red', 2)\n_solid('blue', 4)", None),  # cell: flushed after the cell
    ("def main():\n    _solid('red', 2)\n    _solid('blue', 4)\n    return {'figures': 2}", {}),
])
def test_figures_arrive_as_png_displays_in_order(sandbox, draw, inputs):
    ex = ok(sandbox.run(TWO_FIGURES + draw, inputs=inputs))
    assert [sorted(d) for d in ex.displays] == [["image/png", "text/plain"]] * 2
    assert [centre_colour(d) for d in ex.displays] == [(1.0, 0.0, 0.0), (0.0, 0.0, 1.0)]
    assert [d["text/plain"] for d in ex.displays] == ["<Figure size 100x50 with 1 Axes>",
                                                      "<Figure size 200x50 with 1 Axes>"]
    assert ex.result == ({"figures": 2} if inputs is not None else None)
    ok(sandbox.run("plt.close('all')\ndel _solid"))


def test_ipython_display_types(sandbox):
    code = """
from IPython.display import HTML, JSON, SVG, Markdown, display
display(HTML("<b>bold</b>"))
display(Markdown("# Title"))
display(JSON({"k": [1, 2]}))
display(SVG('<svg xmlns="http://www.w3.org/2000/svg" width="4" height="4"/>'))
"""
    ex = ok(sandbox.run(code))
    assert [{k: v for k, v in d.items() if k != "text/plain"} for d in ex.displays] == [
        {"text/html": "<b>bold</b>"},
        {"text/markdown": "# Title"},
        {"application/json": {"k": [1, 2]}},
        {"image/svg+xml": '<svg xmlns="http://www.w3.org/2000/svg" width="4" height="4"/>'},
    ]
    assert ex.stderr == ""


def test_dataframe_as_html_and_text(sandbox):
    code = ("import pandas as pd\n_df = pd.DataFrame({'x': [1, 2], 'y': ['a', 'b']})\n"
            "display(_df)\n_df")
    ex = ok(sandbox.run(code))
    (shown,) = ex.displays
    assert shown["text/plain"] == "   x  y\n0  1  a\n1  2  b"
    html = shown["text/html"]
    assert html.count("<table") == 1 and "<td>a</td>" in html and "<td>b</td>" in html
    assert ex.text == "   x  y\n0  1  a\n1  2  b"
    ok(sandbox.run("del _df"))


def test_matplotlib_sets_up_fonts_and_cache_quietly(fresh_sandbox):
    # A fresh kernel builds matplotlib's font cache from nothing: nothing may warn or fail.
    code = """
import os, io
import matplotlib
import matplotlib.pyplot as plt
from matplotlib import font_manager
fig, ax = plt.subplots()
ax.set_title("Fonts: éàü")
fig.savefig(io.BytesIO(), format="png")
cache = matplotlib.get_cachedir()
print(os.path.basename(font_manager.findfont("DejaVu Sans", fallback_to_default=False)))
print(any(name.startswith("fontlist") for name in os.listdir(cache)), os.access(cache, os.W_OK))
plt.close("all")
"""
    ex = ok(fresh_sandbox.run(code))
    assert ex.stderr == ""
    assert ex.stdout == "DejaVuSans.ttf\nTrue True\n"
