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
    assert graph["jaxppo.errors"] == set() and graph["jaxppo.process"] == {"jaxppo.errors"}
    # config checks `search` and `pbt` with jaxppo.search.space, itself a leaf over errors;
    # its fields are declared with jaxppo.config_fields, files read with jaxppo.config_files,
    # env objects named with jaxppo.envs.record (which imports nothing of jaxppo), and the
    # compilation cache's default folder is jaxppo.process's
    assert graph["jaxppo.search.space"] == {"jaxppo.errors"}
    assert graph["jaxppo.config_fields"] == {"jaxppo.errors"}
    assert graph["jaxppo.config_files"] == {"jaxppo.errors", "jaxppo.config_fields"}
    assert graph["jaxppo.envs.record"] == set()
    assert graph["jaxppo.config"] == {"jaxppo.errors", "jaxppo.search.space", "jaxppo.config_fields",
                                      "jaxppo.config_files", "jaxppo.envs.record",
                                      "jaxppo.process"}


# What a folder never imports: the algorithm knows nothing of runs, searches, Ray or the CLI;
# envs know nothing of the algorithm; a run knows nothing of Ray or the CLI.
FORBIDDEN = {
    "core": ("run", "search", "distributed", "cli", "program"),
    "envs": ("core", "run", "search", "distributed", "cli", "program"),
    "program": ("run", "distributed", "cli"),
    "run": ("distributed", "cli"),
}

# core/ is a layer: it imports only the leaves below it (errors, the config and the modules
# the config is declared with) and, of envs/, the spec of an env (envs/spec.py: EnvSpec, the
# observation and action helpers, running the reward hooks `resolve` built). Building envs,
# importing a user's network module and resolving a config all happen above it.
CORE_MAY_IMPORT = {"jaxppo.errors", "jaxppo.config", "jaxppo.config_fields", "jaxppo.config_files",
                   "jaxppo.envs.spec"}


def test_folders_import_only_what_their_layer_may():
    for m, deps in _imports().items():
        parts = m.split(".")
        if len(parts) < 3 or parts[1] not in FORBIDDEN:
            continue
        for d in deps:
            top = d.split(".")[1] if d != "jaxppo" else ""
            assert top not in FORBIDDEN[parts[1]], f"{m} imports {d}"


def test_core_imports_only_the_leaves_below_it():
    for m, deps in _imports().items():
        if m.startswith("jaxppo.core."):
            above = {d for d in deps
                     if d not in CORE_MAY_IMPORT and not d.startswith("jaxppo.core")}
            assert not above, f"{m} imports {sorted(above)}, above core/"


def _listed(path: str) -> str:
    """A Code layout entry as a module name ("core/gae.py" -> "jaxppo.core.gae") or a folder
    prefix ("distributed/" -> "jaxppo.distributed")."""
    return "jaxppo." + path.removesuffix(".py").rstrip("/").replace("/", ".")


def test_code_layout_lists_every_module_below_what_it_imports():
    """The Code layout table of docs/design.md says a module uses only those above it (or in
    its row); a folder entry (`distributed/`) stands for every module in it."""
    import re

    design = (PKG.parent / "docs" / "design.md").read_text()
    text = design.split("## Code layout", 1)[1].split("\n## ", 1)[0]
    rank = {}
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    for i, row in enumerate(rows):
        for path in re.findall(r"`([a-z_/]+(?:\.py|/))`", row):
            rank[_listed(path)] = i
    graph = _imports()

    def entry(m):  # the most specific entry that lists module m
        while m not in rank and "." in m:
            m = m.rsplit(".", 1)[0]
        return m

    packages = {"jaxppo", "jaxppo.core", "jaxppo.envs", "jaxppo.program", "jaxppo.run",
                "jaxppo.search"}
    missing = sorted(m for m in graph if m not in packages and entry(m) not in rank)
    assert not missing, f"modules missing from docs/design.md's Code layout: {missing}"
    for m, deps in graph.items():
        if m in packages or entry(m) == "jaxppo.distributed":
            continue
        for d in deps:
            if d not in packages and entry(d) != entry(m):
                assert rank[entry(d)] <= rank[entry(m)], f"{m} imports {d}, listed below it"


MAX_FUNCTION_LINES = 80


def test_no_function_is_longer_than_a_screen_and_a_half():
    """Every function and method in jaxppo/ spans at most MAX_FUNCTION_LINES lines, its
    docstring included: a longer one does several jobs, each of which can be named."""
    long = []
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(PKG.parent)}:{node.name} ({lines} lines)")
    assert not long, long
