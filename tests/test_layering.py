"""Packages depend one way (docs/architecture.md): ``broker`` at the bottom; ``producer``,
``workers``, ``consumer`` and ``envs`` above it; the ``interactor`` command line on top.

Two checks: every import statement in a lower package's source names only packages it may use
(static, so an import inside a function counts too), and importing the lower packages loads
no module of ``interactor`` (what a worker container actually runs)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

OURS = {"broker", "producer", "workers", "consumer", "envs", "interactor", "examples", "bench", "tests"}
ALLOWED = {
    "broker": {"broker"},
    "envs": {"envs", "broker"},
    "producer": {"producer", "broker", "envs"},
    "workers": {"workers", "broker", "envs"},
    "consumer": {"consumer", "broker"},
}


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


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_lower_packages_import_only_what_they_may(package):
    crossings = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for name, line in imported_packages(path):
            if name not in ALLOWED[package]:
                crossings.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    assert crossings == [], f"{package} may import only {sorted(ALLOWED[package])}:\n" + "\n".join(crossings)


def test_importing_the_lower_packages_loads_nothing_of_interactor():
    code = ("import sys, importlib, pkgutil\n"
            "for pkg in ('broker', 'producer', 'workers', 'consumer', 'envs'):\n"
            "    mod = importlib.import_module(pkg)\n"
            "    for info in pkgutil.walk_packages(mod.__path__, pkg + '.'):\n"
            "        if info.name != 'workers.tasks':  # the Celery app module reads settings at import\n"
            "            importlib.import_module(info.name)\n"
            "print(sorted(m for m in sys.modules if m == 'interactor' or m.startswith('interactor.')))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=str(ROOT), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_the_checker_sees_a_crossing(tmp_path):
    """The static check is not vacuous: an upward import inside a function is found."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from interactor.cli import main\n    return main\n")
    assert imported_packages(bad) == {("interactor", 2)}
