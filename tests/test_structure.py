"""The package's shape: no import cycles between jaxppo modules, and config.py on its own."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "jaxppo"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """module -> the jaxppo modules it imports anywhere in its file (also inside functions)."""
    modules = {_module_name(p): p for p in PKG.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("jaxppo"):
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    deps.add(sub if sub in modules else node.module)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.startswith("jaxppo"))
        # A package's __init__ is not a dependency of its own modules' imports of siblings.
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def test_no_import_cycles():
    graph = _imports()
    # Importing a submodule runs its package's __init__, which may re-export; leave the
    # packages' __init__ files out so "jaxppo.x imports jaxppo" is not counted as a cycle.
    graph = {k: {d for d in v if d not in ("jaxppo", "jaxppo.distributed")}
             for k, v in graph.items() if k not in ("jaxppo", "jaxppo.distributed")}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                cycle = stack[stack.index(d):] + [d]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_leaf_modules_import_nothing_from_jaxppo_but_errors():
    graph = _imports()
    assert graph["jaxppo.errors"] == set() and graph["jaxppo.runtime"] == set()
    # config checks `search` and `pbt` with jaxppo.population, itself a leaf over errors
    assert graph["jaxppo.population"] == {"jaxppo.errors"}
    assert graph["jaxppo.config"] == {"jaxppo.errors", "jaxppo.population"}


def test_readme_code_layout_lists_every_module_below_what_it_imports():
    """README's Code layout table says a module uses only those above it (or in its row)."""
    import re

    text = (PKG.parent / "README.md").read_text().split("## Code layout", 1)[1].split("\n## ", 1)[0]
    rank = {}
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    for i, row in enumerate(rows):
        for name in re.findall(r"`([a-z_]+)(\.py|/)`", row):
            stem, kind = name
            rank["jaxppo.distributed" if kind == "/" else f"jaxppo.{stem}"] = i
    graph = _imports()
    top = lambda m: "jaxppo.distributed" if m.startswith("jaxppo.distributed") else m  # noqa: E731
    missing = sorted({top(m) for m in graph} - set(rank) - {"jaxppo"})
    assert not missing, f"modules missing from README's Code layout: {missing}"
    for m, deps in graph.items():
        if m == "jaxppo" or m.startswith("jaxppo.distributed"):
            continue
        for d in deps:
            if d != "jaxppo":
                assert rank[top(d)] <= rank[top(m)], f"{m} imports {d}, listed below it"
