"""Which preloaded modules a run's code imports, read statically, and the preload set it runs on.

A stateless run pays for a fork of its pool's zygote and for the exit of what it forked: both
grow with the zygote's memory (~0.03-0.04 ms per MB), so one zygote holding every module a
runtime preloads would tax the runs that import nothing. Runs are therefore served by zygotes
keyed by preload set (hosting/oneshots.py keeps their pools): the lean one for code that imports
nothing heavy, and for the rest the smallest set that holds what the code imports.

The reading never runs the code: `ast.parse`, then `import X`, `from X import Y` (absolute) and
calls of `importlib.import_module`, `import_module` or `__import__` with a literal string. A name
built at run time, an `exec` of an import, code over MAX_SOURCE or that does not parse: nothing
is found and the run takes the lean pool, where its imports work as they always did (slower).

The sets: each preloaded module that no other one loads (a root) is a set of its own, covering
the preloaded modules its import loads (measured when the runtime was built: runtimes/modules.py),
except the light roots (under LIGHT_KB each), which share one set: a fork and an exit cost
~0.03-0.04 ms per MB of the zygote, so a 20 MB set of them costs a run under 1 ms, and it is one
pool instead of several. A run whose modules are held by a set whose pool is running takes it
(never a second pool for what one holds); else the cheapest set holding them; a run needing
modules of several sets gets the union of the fewest sets that cover them.
"""

from __future__ import annotations

import ast
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field

MAX_SOURCE = 256 * 1024  # characters read; past this a run takes the lean pool unread
# A root whose import adds less than this to a zygote (jinja2 3 MB, requests 8 MB; pandas 48 MB)
# shares one set with the other light ones: one pool, not one each, for little more per run.
LIGHT_KB = 10 * 1024
_IMPORTERS = {"import_module", "__import__"}


def imported(code: str) -> frozenset[str]:
    """The top-level names of the modules code imports, read without running it; empty when it
    cannot be read (too long, not Python)."""
    if len(code) > MAX_SOURCE:
        return frozenset()
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return frozenset()
    names: set[str] = set()
    try:
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names.add(node.module.split(".")[0])
            elif isinstance(node, ast.Call) and _importer(node.func) and node.args:
                first = node.args[0]
                if isinstance(first, ast.Constant) and isinstance(first.value, str):
                    names.add(first.value.split(".")[0])
    except RecursionError:
        return frozenset()
    return frozenset(name for name in names if name)


def _importer(func: ast.expr) -> bool:
    """Whether a call's function is one that imports by name."""
    if isinstance(func, ast.Name):
        return func.id in _IMPORTERS
    return isinstance(func, ast.Attribute) and func.attr == "import_module"


@dataclass(frozen=True)
class PreloadSets:
    """The preload sets of a runtime's modules, and the choice of one for a run's code."""

    covers: Mapping[tuple[str, ...], frozenset[str]]  # a set: the preloaded modules it loads
    cost_kb: Mapping[tuple[str, ...], int]  # a set: memory its imports add to a zygote
    base: tuple[str, ...] = ()  # preloaded by every pool, the lean one too (a face's --preload)
    names: frozenset[str] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "names", frozenset().union(*self.covers.values()))

    @classmethod
    def from_record(cls, preload: Iterable[str], modules: Mapping[str, Mapping] | None = None,
                    base: Iterable[str] = (), light_kb: int = LIGHT_KB) -> PreloadSets:
        """The sets of a runtime's preloads; modules: its record's measurements (a module not
        measured covers itself alone). Each root is a set, except that the light roots (their
        import adds less than light_kb) share one set."""
        modules = modules or {}
        preload = sorted(set(preload) - set(base))
        wanted = set(preload)
        loads = {name: (set(modules.get(name, {}).get("loads", ())) & wanted) | {name}
                 for name in preload}
        cost = {name: int(modules.get(name, {}).get("rss_kb", 0)) for name in preload}
        loaded_by_other = {other for name in preload for other in loads[name] - {name}}
        roots = [name for name in preload if name not in loaded_by_other]
        covered = set().union(*(loads[root] for root in roots)) if roots else set()
        roots += [name for name in preload if name not in covered]  # a cycle: its own root
        light = tuple(root for root in roots if 0 < cost[root] < light_kb)
        sets: dict[tuple[str, ...], frozenset[str]] = {
            (root,): frozenset(loads[root]) for root in roots if root not in light}
        costs: dict[tuple[str, ...], int] = {
            (root,): cost[root] for root in roots if root not in light}
        if light:
            sets[light] = frozenset().union(*(loads[root] for root in light))
            costs[light] = sum(cost[root] for root in light)
        return cls(sets, costs, tuple(base))

    def lean(self) -> tuple[str, ...]:
        """The lean pool's preload: only the base."""
        return self.base

    def choose(self, code: str, live: Collection[tuple[str, ...]] = ()) -> tuple[str, ...]:
        """The preload of the pool this code runs on: the lean one unless it imports a
        preloaded module; then a live set holding them if there is one (live: the preloads of
        the pools there are), else the cheapest set holding them (else the fewest sets)."""
        if not any(name in code for name in self.names):  # cheap: most runs stop here
            return self.lean()
        return self.for_modules(imported(code), live)

    def for_modules(self, modules: Collection[str],
                    live: Collection[tuple[str, ...]] = ()) -> tuple[str, ...]:
        """The preload covering these top-level modules (those not preloaded left aside)."""
        needed = set(modules) & self.names
        if not needed:
            return self.lean()
        whole = [key for key, covers in self.covers.items() if needed <= covers]
        if whole:
            running = [key for key in whole if (*self.base, *key) in live]
            best = min(running or whole, key=lambda key: (self.cost_kb[key], key))
            return (*self.base, *best)
        chosen: set[str] = set()
        while needed:  # greedy cover: the set covering most of what is left, cheaper first
            key = max(self.covers, key=lambda key: (len(self.covers[key] & needed),
                                                    -self.cost_kb[key], key))
            chosen.update(key)
            needed -= self.covers[key]
        return (*self.base, *sorted(chosen))
