"""Packages depend one way (docs/architecture.md): ``broker`` at the bottom; ``producer``,
``workers``, ``consumer`` and ``envs`` above it; the ``interactor`` command line above those;
``bench`` and ``examples`` on top, side by side (they use ``interactor``, it uses neither);
nothing imports ``tests``.

The checks: every import statement in a package's source names only packages it may use
(static, so an import inside a function counts too); no ``module:Name`` string (how Celery and
the hooks name a class to load) names a package above; importing the lower packages loads no
module of ``interactor`` (what a worker container actually runs), and importing ``interactor``
loads nothing of ``bench``, ``examples`` or ``tests``."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit  # needs no server: make check runs it

ROOT = Path(__file__).resolve().parent.parent

OURS = {"broker", "producer", "workers", "consumer", "envs", "interactor", "examples", "bench", "tests"}
LOWER = {"broker", "producer", "workers", "consumer", "envs"}
ALLOWED = {
    "broker": {"broker"},
    "envs": {"envs"},  # the env side stands alone: an env server needs nothing of the runner
    "producer": {"producer", "broker", "envs"},
    "workers": {"workers", "broker", "envs"},
    "consumer": {"consumer", "broker"},
    "interactor": LOWER | {"interactor"},
    "bench": LOWER | {"interactor", "bench"},
    "examples": LOWER | {"interactor", "examples"},
}
_LOADS = re.compile(r"^([a-z_]+)(?:\.[A-Za-z_]\w*)*:[A-Za-z_][\w.]*$")  # "module:Name"


def imported_packages(path: Path) -> set[tuple[str, int]]:
    tree = ast.parse(path.read_text(), str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.add((alias.name.split(".")[0], node.lineno))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add((node.module.split(".")[0], node.lineno))
    return {(name, line) for name, line in found if name in OURS}


def loaded_by_name(path: Path) -> set[tuple[str, int]]:
    """Our packages named by a ``module:Name`` string (a class loaded by name: an import the
    import statements do not show)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            m = _LOADS.match(node.value)
            if m and m[1] in OURS:
                found.add((m[1], node.lineno))
    return found


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_packages_import_only_what_they_may(package):
    crossings = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for name, line in imported_packages(path):
            if name not in ALLOWED[package]:
                crossings.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    assert crossings == [], f"{package} may import only {sorted(ALLOWED[package])}:\n" + "\n".join(crossings)


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_no_class_is_loaded_by_name_from_a_package_above(package):
    crossings = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for name, line in loaded_by_name(path):
            if name not in ALLOWED[package]:
                crossings.append(f"{path.relative_to(ROOT)}:{line} names {name}")
    assert crossings == [], f"{package} may load only from {sorted(ALLOWED[package])}:\n" + "\n".join(crossings)


def _last_line_of(code: str) -> str:
    """Run ``code`` in a fresh interpreter (nothing imported yet) and return its last line."""
    out = subprocess.run([sys.executable, "-c", code], cwd=str(ROOT), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


def test_importing_the_lower_packages_loads_nothing_of_interactor():
    code = ("import sys, importlib, pkgutil\n"
            "for pkg in ('broker', 'producer', 'workers', 'consumer', 'envs'):\n"
            "    mod = importlib.import_module(pkg)\n"
            "    for info in pkgutil.walk_packages(mod.__path__, pkg + '.'):\n"
            "        if info.name != 'workers.tasks':  # the Celery app module reads settings at import\n"
            "            importlib.import_module(info.name)\n"
            "print(sorted(m for m in sys.modules if m == 'interactor' or m.startswith('interactor.')))\n")
    assert _last_line_of(code) == "[]"


def test_the_checker_sees_a_crossing(tmp_path):
    """The static check is not vacuous: an upward import inside a function is found."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from interactor.cli import main\n    return main\n")
    assert imported_packages(bad) == {("interactor", 2)}


def test_importing_interactor_loads_nothing_of_bench_examples_or_tests():
    code = ("import sys, importlib, pkgutil\n"
            "import interactor\n"
            "for info in pkgutil.walk_packages(interactor.__path__, 'interactor.'):\n"
            "    importlib.import_module(info.name)\n"
            "import interactor.cli\n"
            "interactor.cli.build_parser()\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('bench', 'examples', 'tests')))\n")
    assert _last_line_of(code) == "[]"


def test_the_checker_sees_a_class_named_from_above(tmp_path):
    """The string check is not vacuous: Celery's consumer named by path in broker/ is found."""
    bad = tmp_path / "bad.py"
    bad.write_text('conf = dict(worker_consumer="workers.celery_consumer:EpisodeConsumer")\n')
    assert loaded_by_name(bad) == {("workers", 1)}


def module_imports(root: Path, packages: set[str]) -> dict[str, set[str]]:
    """Each module of ``packages`` under ``root`` and the modules of them it imports: every
    import statement, in function bodies and ``if TYPE_CHECKING:`` blocks too (an import for a
    type annotation is still a dependency a reader must follow). ``from pkg import name`` is an
    edge to the submodule ``pkg.name`` where there is one, else to ``pkg``."""
    modules: dict[str, Path] = {}
    for package in packages:
        for path in (root / package).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def known(name: str) -> str:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps.update(known(alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                    base = ".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else []))
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    deps.add(full if full in modules else known(base))
        graph[name] = deps - {name, ""}
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The sets of modules that import one another round a circle (strongly connected
    components of more than one module, Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    for root_node in sorted(graph):
        if root_node in index:
            continue
        work = [(root_node, iter(sorted(graph[root_node])))]
        index[root_node] = low[root_node] = len(index)
        stack.append(root_node)
        on_stack.add(root_node)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in graph:
                    continue
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    members = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        members.append(member)
                        if member == node:
                            break
                    if len(members) > 1:
                        circles.append(sorted(members))
    return circles


def test_no_module_imports_itself_round_a_circle():
    """Within and across packages, bench/ and examples/ included: a circle means one module
    cannot be read, tested or changed without the others (the worker's attempt, runner and
    trajectory once were one)."""
    assert import_circles(module_imports(ROOT, set(ALLOWED))) == []


def test_the_circle_check_sees_a_circle_hidden_behind_type_checking(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import B\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.c import C\nB = 1\n")
    (pkg / "c.py").write_text("def f():\n    from pkg import a\n")
    (pkg / "d.py").write_text("from pkg import a\n")
    assert import_circles(module_imports(tmp_path, {"pkg"})) == [["pkg.a", "pkg.b", "pkg.c"]]


@pytest.mark.parametrize("package", sorted(LOWER | {"interactor"}))
def test_docs_architecture_names_every_module_of_a_package(package):
    """docs/architecture.md's row of a package names each of its modules (as `name.py`, or
    `folder/` for a subpackage): a module nobody can find on that page is a module a newcomer
    meets unexplained."""
    row = next(line for line in (ROOT / "docs" / "architecture.md").read_text().splitlines()
               if line.startswith(f"| `{package}/` |"))
    unnamed = [path.name for path in sorted((ROOT / package).glob("*.py"))
               if path.name != "__init__.py" and f"`{path.name}`" not in row]
    assert unnamed == [], f"docs/architecture.md's {package}/ row does not name: {unnamed}"


MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 100


def test_modules_and_functions_stay_readable():
    """No module of the product, bench/ or examples/ over 600 lines, no function over 100 (one
    screen of a loop, as docs/architecture.md asks), and no two modules sharing a file name
    (one name, one thing): a newcomer reads each in one sitting and greps a name to one file."""
    too_long, names = [], {}
    for package in sorted(ALLOWED):
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT)
            text = path.read_text()
            if text.count("\n") > MAX_MODULE_LINES:
                too_long.append(f"{rel}: {text.count(chr(10))} lines")
            for node in ast.walk(ast.parse(text, str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > MAX_FUNCTION_LINES:
                        too_long.append(f"{rel}:{node.lineno} {node.name}(): {lines} lines")
            if path.name != "__init__.py":
                names.setdefault(path.name, []).append(str(rel))
    shared = {name: paths for name, paths in names.items() if len(paths) > 1}
    assert too_long == [] and shared == {}, f"too long: {too_long}; file names shared: {shared}"
