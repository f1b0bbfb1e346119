"""The package's shape: imports that only look down, and files about one thing.

The import graph of pynanoqwen/ is read from the source (ast), every import counted: at module
level and inside functions alike, so an import moved into a function to dodge a circle still
closes the circle here. It must have no cycle. And no module may exceed MAX_LINES.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "pynanoqwen"
MAX_LINES = 500
# Files over MAX_LINES that another branch is changing right now; each entry must go once it is
# split (test_no_module_is_over_the_line_limit fails on an entry that is already short enough).
PENDING_SPLITS = {
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in PACKAGE.rglob("*.py")}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The pynanoqwen modules `path` imports, wherever the import statement stands."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            submodules = {f"{base}.{alias.name}" for alias in node.names} & known  # `from package import module`
            found |= submodules
            if len(submodules) < len(node.names):  # a name defined in `base` itself
                found.add(base)
    return {module for module in found if module in known and module != name}


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, set(known)) for name, path in known.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a path [a, b, ..., a], or None."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                return stack[stack.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_graph_reader_sees_relative_and_function_level_imports():
    graph = import_graph()
    assert "pynanoqwen.engine.schedule" in graph["pynanoqwen.engine.backend"]  # `from .schedule import ...`
    assert "pynanoqwen.device" in graph["pynanoqwen.generate"]  # `from . import device as ...`
    assert "pynanoqwen.engine" in graph["pynanoqwen.backends"]  # inside load_engine
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_the_package_imports_no_circle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_no_command_module_is_imported_by_another_module():
    """validate, bench and cli are commands: nothing in the package builds on them (cli imports
    the command modules, and __main__ runs cli)."""
    graph = import_graph()
    commands = {"pynanoqwen.validate", "pynanoqwen.bench", "pynanoqwen.cli"}
    importers = {name: sorted(graph[name] & commands) for name in graph
                 if graph[name] & commands and name not in ("pynanoqwen.cli", "pynanoqwen.__main__")}
    assert importers == {}


def test_no_module_is_over_the_line_limit():
    lengths = {str(path.relative_to(PACKAGE)): len(path.read_text().splitlines()) for path in PACKAGE.rglob("*.py")}
    too_long = {path: n for path, n in lengths.items() if n > MAX_LINES and path not in PENDING_SPLITS}
    assert too_long == {}
    assert [path for path in PENDING_SPLITS if lengths.get(path, 0) <= MAX_LINES] == [], "drop them from the list"
