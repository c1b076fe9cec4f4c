"""The import-layers contract (#46): the package's layers, written down once, here, and checked.

Each layer may import only the layers below it (and itself); the faces never import one another;
no module imports itself back through others (no circles, lazy imports inside functions
included: a lazy import is still a dependency; only `if TYPE_CHECKING:` blocks are left out).
docs/architecture.md draws this table as a map and says where a new face feature goes.

The graph is read from the source with `ast` (no import runs), so the test is fast enough to
sit beside ruff and mypy in the lint test's company.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "sandbox_kernel"

# Bottom to top: (layer, the top-level modules and subpackages in it).
LAYERS: list[tuple[str, frozenset[str]]] = [
    # What every side shares and that imports nothing of ours: the error vocabulary, the
    # wire format, the result checker's process, the extras' names, the words of a policy
    # change (advice: confine/denials words refusals with them).
    ("base", frozenset({"__init__", "errors", "jsonwire", "resultcheck", "extras", "advice",
                          "fdwait"})),
    ("confine", frozenset({"confine"})),  # the confinement layers and their companion
    # The policy every side reads, the caller's secrets it holds, its command-line flags.
    ("policy", frozenset({"secrets", "policy", "flags"})),
    ("kernel", frozenset({"kernel"})),  # the kernel process: runner, transports
    # Ways to get a kernel: the fork server, the provisioner, the kernelspec Jupyter reads
    # (install.py writes it; cli.py is the command), the runtimes kernels run on.
    ("launch", frozenset({"launch", "install", "runtimes"})),
    ("client", frozenset({"client"})),  # the caller's side: Sandbox, AsyncSandbox
    # Handing kernels to many callers: sources, fresh runs, sessions, pausing, the store.
    ("hosting", frozenset({"hosting"})),
    # Protocol translation only. `frameworks` is the agent-framework adapters' place (the
    # code-mode issue): a face above client/, as the service and the MCP server are.
    ("faces", frozenset({"service", "mcp", "frameworks"})),
    ("cli", frozenset({"cli", "check", "__main__"})),  # the command line and entry point
]
FACES = "faces"  # its units import no other unit of it
# Old import paths kept for callers outside the package, each the one import up it makes.
ALIASES = {
    "sandbox_kernel.launch.pool": "the warm pools moved to hosting/pool.py (#46)",
}


def module_name(path: Path, root: Path) -> str:
    """The dotted name of a module file under root's parent."""
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(root: Path) -> dict[str, set[str]]:
    """Every module of the package at root and the package's modules it imports."""
    files = {module_name(path, root): path for path in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        found: set[str] = set()
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in _nodes(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets: Iterable[str] = (alias.name for alias in node.names)
            else:
                base = package[:len(package) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                # `from . import x` imports the module x when there is one, else a name of .
                targets = (f"{target}.{alias.name}" if f"{target}.{alias.name}" in files
                           else target for alias in node.names)
            found.update(_owner(target, files) for target in targets)
        graph[name] = found - {"", name}
    return graph


def _nodes(tree: ast.AST) -> Iterable[ast.Import | ast.ImportFrom]:
    """The import statements of a module, at any depth, but those under `if TYPE_CHECKING:`."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for other in node.orelse:
                yield from _nodes(other)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        yield from _nodes(node)


def _owner(target: str, files: dict[str, Path]) -> str:
    """The module of ours an import names ("" for none: another distribution's)."""
    while target and target not in files:
        target = target.rpartition(".")[0]
    return target


def unit(module: str) -> str:
    """The top-level module or subpackage a module belongs to (`__init__` for the root)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def layer_of(name: str, layers: list[tuple[str, frozenset[str]]]) -> int | None:
    """The index of the layer a unit is placed in (None: placed nowhere)."""
    return next((n for n, (_, units) in enumerate(layers) if name in units), None)


def violations(graph: dict[str, set[str]], layers: list[tuple[str, frozenset[str]]],
               faces: str = FACES) -> list[str]:
    """Every unplaced unit, arrow up and import between faces, one line each."""
    found = sorted({f"{unit(m)} is in no layer" for m in graph
                    if layer_of(unit(m), layers) is None})
    face = next((n for n, (name, _) in enumerate(layers) if name == faces), None)
    for module, targets in sorted(graph.items()):
        if module in ALIASES:
            continue
        here = layer_of(unit(module), layers)
        for target in sorted(targets):
            there = layer_of(unit(target), layers)
            if here is None or there is None or unit(target) == unit(module):
                continue
            if there > here:
                found.append(f"{module} -> {target}: {layers[here][0]} imports "
                             f"{layers[there][0]}, a layer above it")
            elif here == there == face:
                found.append(f"{module} -> {target}: a face imports another face")
    return found


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The modules that import themselves back through others (strongly connected
    components of more than one module, Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in graph.get(module, ()):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_every_module_is_placed_and_no_import_points_up_or_across_faces():
    assert violations(imports(PACKAGE), LAYERS) == []


def test_no_module_imports_itself_back():
    assert circles(imports(PACKAGE)) == []


def test_each_unit_is_placed_once():
    placed = [name for _, units in LAYERS for name in units]
    assert len(placed) == len(set(placed))


@pytest.fixture
def fake(tmp_path: Path) -> Path:
    """A tiny package with one arrow up, one import between faces and one circle."""
    root = tmp_path / "pkg"
    files = {
        "__init__.py": "",
        "low/__init__.py": "",
        "low/a.py": "from ..high import b\n",  # up
        "high/__init__.py": "",
        "high/b.py": "def f():\n    from . import c\n",  # lazy, but a dependency
        "high/c.py": "from .b import f\nfrom typing import TYPE_CHECKING\n"
                     "if TYPE_CHECKING:\n    from ..low import a\n",  # left out
        "web/__init__.py": "from ..chat import x\n",
        "chat/__init__.py": "x = 1\n",
        "stray.py": "",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_the_checker_catches_an_arrow_up_a_face_importing_a_face_and_a_circle(fake):
    layers = [("low", frozenset({"__init__", "low"})), ("high", frozenset({"high"})),
              ("faces", frozenset({"web", "chat"}))]
    graph = imports(fake)
    assert graph["pkg.high.c"] == {"pkg.high.b"}  # the TYPE_CHECKING import is left out
    assert violations(graph, layers) == [
        "stray is in no layer",
        "pkg.low.a -> pkg.high.b: low imports high, a layer above it",
        "pkg.web -> pkg.chat: a face imports another face"]
    assert circles(graph) == [["pkg.high.b", "pkg.high.c"]]
