"""brisk's modules import one another without circles: every import counts (module level, inside functions, under
TYPE_CHECKING), read from the source with `ast`, so a circle fails here before it fails (or hides) at run time."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "brisk"


def module_files(package: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module under `package` (namespace packages included)."""
    modules = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of `modules` that `name` imports: `from a import b` names a.b where that is a module, else a."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]

    def known(dotted: str) -> str | None:
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        found.update(m for m in map(known, targets) if m is not None and m != name)
    return found


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_circles_in_brisk():
    modules = module_files(PACKAGE)
    graph = {name: imported_modules(name, path, modules) for name, path in modules.items()}
    assert len(graph) > 100 and "brisk.server.app" in graph  # every module, the namespace package's too
    assert import_cycles(graph) == []


@pytest.mark.parametrize(
    "sources, cycles",
    [
        ({"a": "import pkg.b", "b": "from pkg import c", "c": ""}, []),
        ({"a": "import pkg.b", "b": "from . import a"}, [["pkg.a", "pkg.b"]]),
        (
            {
                "a": "from pkg.b import x",
                "b": "if TYPE_CHECKING:\n    from pkg.c import y",
                "c": "def f():\n    import pkg.a",
            },
            [["pkg.a", "pkg.b", "pkg.c"]],
        ),
    ],
    ids=["chain", "relative", "type-checking-and-function-level"],
)
def test_the_check_finds_circles(tmp_path, sources, cycles):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name, source in sources.items():
        (package / f"{name}.py").write_text(source)
    modules = module_files(package)
    assert import_cycles({n: imported_modules(n, p, modules) for n, p in modules.items()}) == cycles
