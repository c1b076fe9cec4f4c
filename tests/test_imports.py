"""launch/imports.py: a run's imports read without running it, and the preload set chosen."""

import pytest

from sandbox_kernel.launch.imports import MAX_SOURCE, PreloadSets, imported

# As a runtime built from deploy/service/python-requirements.txt records them (abridged).
MODULES = {
    "jinja2": {"loads": ["jinja2", "markupsafe"], "rss_kb": 4000},
    "markupsafe": {"loads": ["markupsafe"], "rss_kb": 300},
    "requests": {"loads": ["certifi", "idna", "requests", "urllib3"], "rss_kb": 9000},
    "urllib3": {"loads": ["urllib3"], "rss_kb": 4000},
    "certifi": {"loads": ["certifi"], "rss_kb": 100},
    "idna": {"loads": ["idna"], "rss_kb": 200},
    "numpy": {"loads": ["numpy"], "rss_kb": 20000},
    "pandas": {"loads": ["dateutil", "numpy", "pandas", "pytz"], "rss_kb": 60000},
    "dateutil": {"loads": ["dateutil"], "rss_kb": 500},
    "pytz": {"loads": ["pytz"], "rss_kb": 300},
    "matplotlib": {"loads": ["matplotlib", "numpy"], "rss_kb": 30000},
    "pylab": {"loads": ["matplotlib", "numpy", "pylab"], "rss_kb": 45000},
}
SETS = PreloadSets.from_record(MODULES, MODULES)


def test_every_form_of_a_literal_import_is_read():
    code = ("import os.path, json as j\nfrom pandas.core import frame\nfrom . import sibling\n"
            "def main():\n    import numpy\n    importlib.import_module('jinja2.ext')\n"
            "    __import__('requests')\n    import_module('yaml')\n")
    assert imported(code) == {"os", "json", "pandas", "numpy", "jinja2", "requests", "yaml"}


@pytest.mark.parametrize("code", [
    "__import__('pan' + 'das')",  # a name built at run time
    "name = 'pandas'\n__import__(name)",
    "exec('import pandas')",  # an import inside a string
    "eval(compile('import pandas', 'x', 'exec'))",
    "import pandas" + " " * MAX_SOURCE,  # too long to read: not read at all
    "import pandas\ndef broken(:\n",  # not Python
    "(" * 100_000 + ")" * 100_000 + "\nimport pandas",  # too deep for the parser
    "x = " + "-" * 200_000 + "1\nimport pandas",  # too deep for the walk
    "import pandas\x00",
])
def test_what_cannot_be_read_without_running_it_goes_to_the_lean_pool(code):
    assert SETS.choose(code) == ()


def test_the_roots_are_the_modules_no_other_loads_and_the_light_ones_share_a_set():
    assert sorted(SETS.covers) == [("jinja2", "requests"), ("pandas",), ("pylab",)]
    assert SETS.covers[("pandas",)] == {"dateutil", "numpy", "pandas", "pytz"}
    assert SETS.covers[("jinja2", "requests")] == {
        "certifi", "idna", "jinja2", "markupsafe", "requests", "urllib3"}
    assert SETS.cost_kb[("jinja2", "requests")] == 13000


@pytest.mark.parametrize(("code", "preload"), [
    ("def main():\n    return {'a': 1}\n", ()),
    ("import json, os\nprint('pandas')", ()),  # the name only in a string
    ("import jinja2", ("jinja2", "requests")),
    ("from markupsafe import escape", ("jinja2", "requests")),
    ("import requests", ("jinja2", "requests")),
    ("import numpy as np", ("pylab",)),  # the cheaper of the two sets holding numpy
    ("import pandas as pd", ("pandas",)),
    ("import matplotlib.pyplot as plt", ("pylab",)),
    ("import pandas, jinja2", ("jinja2", "pandas", "requests")),  # no one set: the fewest
    ("import pandas, matplotlib", ("pandas", "pylab")),
    ("import pandas, yaml", ("pandas",)),  # a module not preloaded changes nothing
])
def test_a_run_gets_the_cheapest_set_holding_what_it_imports(code, preload):
    assert SETS.choose(code) == preload


def test_a_set_running_already_is_taken_over_a_cheaper_one_not_running():
    assert SETS.choose("import numpy") == ("pylab",)
    assert SETS.choose("import numpy", live=[("pandas",)]) == ("pandas",)
    assert SETS.choose("import numpy", live=[("pandas",), ("pylab",)]) == ("pylab",)
    assert SETS.choose("import numpy", live=[("jinja2", "requests")]) == ("pylab",)


def test_a_base_preload_is_in_every_set_and_a_record_without_measures_still_works():
    sets = PreloadSets.from_record(["numpy", "pandas", "base"], None, base=["base"])
    assert sets.lean() == ("base",)
    assert sets.choose("x = 1") == ("base",)
    assert sets.choose("import pandas") == ("base", "pandas")
    assert sets.choose("import numpy") == ("base", "numpy")
