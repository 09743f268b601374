"""No import circle anywhere in the five packages, and registries filled only through their functions.

The graph holds every import a module makes, at module level or inside a function (a function-level
import hides a circle from Python until the function runs, not from a reader), with an edge to each
package `__init__` that importing a dotted name runs. A circle means two modules cannot be read, or
changed, one without the other.
"""

import ast
import functools
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOURCES = sorted(REPO.glob("packages/*/src"))


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the five packages."""
    modules = {}
    for src in SOURCES:
        for path in src.rglob("*.py"):
            parts = path.relative_to(src).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            modules[name] = path
    return modules


def _imported_names(path: Path, module: str) -> set[str]:
    """Every dotted name `path` imports (relative imports made absolute; `from a import b` gives `a.b`
    as well as `a`, since b may be a module)."""
    is_package = path.name == "__init__.py"
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, *([base] if base else [])])
            names.add(base)
            names |= {f"{base}.{alias.name}" for alias in node.names}
    return names


@functools.cache
def import_graph() -> dict[str, set[str]]:
    """module -> the project's modules importing it runs (each package `__init__` on the way included,
    but not the importer's own packages, which are already running)."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 2)}
        targets = set()
        for imported in _imported_names(path, name):
            parts = imported.split(".")
            targets |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)} & modules.keys()
        graph[name] = targets - own
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_import_graph_reads_every_package_and_a_known_edge():
    graph = import_graph()
    assert {name.split(".")[0] for name in graph} == {
        "titan_models",
        "titan_parallel",
        "titan_data",
        "titan_ckpt",
        "titan_train",
    }
    assert "titan_train.plan" in graph["titan_train.trainer"]
    assert "titan_train.config" in graph["titan_train.wiring.optimizers"]  # a package's __init__ runs


def test_no_module_of_the_five_packages_imports_itself_through_others():
    assert circles(import_graph()) == []


def _room(module: str, package: str) -> str | None:
    """The room of `package` that holds `module`: the child module or sub-package its name starts with
    (None for the package's own `__init__` and for modules outside it)."""
    if not module.startswith(package + "."):
        return None
    return f"{package}.{module[len(package) + 1 :].split('.')[0]}"


def room_circles(graph: dict[str, set[str]]) -> list[str]:
    """Inside every package, at every depth, the circles between its rooms (a child module, or a
    sub-package taken whole), each with the module imports that tie it: a room importing a room that
    stands above it closes one."""
    packages = {name for name in graph if any(other.startswith(name + ".") for other in graph)}
    found = []
    for package in sorted(packages):
        rooms: dict[str, set[str]] = {}
        ties: dict[tuple[str, str], list[str]] = {}
        for module, targets in graph.items():
            here = _room(module, package)
            if here is None:
                continue
            rooms.setdefault(here, set())
            for target in targets:
                there = _room(target, package)
                if there is not None and there != here:
                    rooms[here].add(there)
                    ties.setdefault((here, there), []).append(f"{module} -> {target}")
        for circle in circles(rooms):
            why = [tie for a in circle for b in circle for tie in ties.get((a, b), [])]
            found.append(f"{' <-> '.join(circle)}: {'; '.join(sorted(why))}")
    return found


def test_inside_each_package_no_room_imports_one_that_stands_above_it():
    # A room is a package's child module or sub-package: titan_train's plan, wiring and config, titan-data's
    # datasets and shards. They stack in floors (plan over wiring over run_plan; faults over config; the
    # shard writer over datasets over the shard format), so each can be read with only those below it.
    assert room_circles(import_graph()) == []


def test_a_room_circle_is_found_and_named():
    graph = {
        "pkg": set(),
        "pkg.low": set(),
        "pkg.low.a": {"pkg.high.b"},
        "pkg.high": set(),
        "pkg.high.b": {"pkg.low.a"},
    }
    assert room_circles(graph) == ["pkg.high <-> pkg.low: pkg.high.b -> pkg.low.a; pkg.low.a -> pkg.high.b"]


# Registries hold what their register_* functions put there: an assignment into one from a test or a
# benchmark would bypass the function's checks (and, for model flavors, no longer reaches the registry).
REGISTRY_DICTS = ("FLAVORS", "MODELS", "DATASETS", "FAMILIES", "ASSETS")


def _registry_writes(path: Path) -> list[str]:
    """`path:line: code` for each item assignment into, or mutating call on, an imported registry dict."""
    tree = ast.parse(path.read_text(), str(path))
    imported = {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }

    def is_registry(expr: ast.expr) -> bool:
        name = expr.id if isinstance(expr, ast.Name) else expr.attr if isinstance(expr, ast.Attribute) else ""
        return any(name.endswith(r) for r in REGISTRY_DICTS) and (
            isinstance(expr, ast.Attribute) or name in imported
        )

    found = []
    for node in ast.walk(tree):
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, (ast.AugAssign, ast.AnnAssign))
            else []
        )
        hits = [t for t in targets if isinstance(t, ast.Subscript) and is_registry(t.value)]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            mutating = node.func.attr in ("setdefault", "update", "__setitem__", "pop")
            hits += [node] if mutating and is_registry(node.func.value) else []
        found += [f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)}" for _ in hits]
    return found


def test_tests_and_benchmarks_register_through_the_public_functions():
    files = [*REPO.glob("tests/**/*.py"), *REPO.glob("bench/**/*.py"), *REPO.glob("packages/*/tests/**/*.py")]
    # Hidden folders are environments the benchmarks build (bench/.torchtitan-0.2.2-env), not the project's.
    files = [p for p in files if not any(part.startswith(".") for part in p.relative_to(REPO).parts)]
    writes = [w for path in sorted(files) for w in _registry_writes(path)]
    assert writes == [], "use titan_train.registry.register_flavor / titan_data.register_dataset"
