"""The original driver's side of the comparison in bench/original_driver.py: runs the launcher of
the project this one was rebuilt from (BinHuangPJLAB/Safactory: ``launcher.py``, its
``EnvPoolManager`` and ``Interactor``), from a checkout of it, against the bench's stand-ins.

Run as a script, never imported by the rest of the bench: the original's top-level names
(``interactor``, ``env``, ``core``, ``manager``, ``utils``) must resolve to the checkout, so this
file puts the checkout first on ``sys.path`` and imports nothing of ours. Nothing of the original
is copied here; it is run as its launcher runs it (``python launcher.py --mode local ...``):
the task file's rows go into its SQLite table (``sync_configs_to_db``), its pool manager resets
C x its multiplier env instances ahead and refills one as an episode ends (DELETE, then the next
row's reset), its ``Interactor`` drives C episodes at once and records every step through its
``DataManager`` (SQLite, buffered, on a path in the run's folder).

Two import shims, both for code the run never executes, are printed when used:
* ``wandb``: the launcher imports ``utils``, whose ``__init__`` imports ``rl.utils.metrics``,
  which imports ``wandb`` for a metrics recorder the launcher does not use (not installed here).
* ``env.env_factory``: at the checkout's HEAD it imports ``_import_gym_env``, a name
  ``env/registry.py`` does not define (ImportError); ``manager/actor_pool.py`` uses the module
  only for in-process envs, and this run uses HTTP.

``--check`` only tries the imports (exit 0, or 1 with the reason on stderr).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import types
from pathlib import Path


def _shim(name: str, module: types.ModuleType, why: str) -> None:
    sys.modules[name] = module
    print(f"original runner: shim for {name} ({why})", file=sys.stderr, flush=True)


def import_original(path: str):
    """Import the original's launcher from ``path``; return the module."""
    here = str(Path(__file__).resolve().parent)
    sys.path[:] = [p for p in sys.path if p not in ("", here, os.getcwd())]
    sys.path.insert(0, path)
    try:
        import wandb  # noqa: F401
    except ImportError:
        _shim("wandb", types.ModuleType("wandb"), "imported by rl/utils/metrics.py, unused by the launcher")
    try:
        import env.env_factory  # noqa: F401
    except ImportError as exc:
        stub = types.ModuleType("env.env_factory")
        reason = str(exc)  # Python unbinds exc at the end of this block; the stub raises later

        def unavailable(*_a, **_k):
            raise RuntimeError(f"in-process envs are unavailable in this checkout: {reason}")

        stub.normalize_create_kwargs = stub.resolve_env_class = unavailable
        _shim("env.env_factory", stub, f"{exc}; used only for in-process envs")
    import launcher

    return launcher


def write_configs(folder: Path, env_url: str, reset_concurrency: int) -> tuple[Path, Path]:
    """The manager's config (local mode, the env stand-in's port, the reset concurrency) and an
    experience config with injection off (its shipped one points at a cluster path)."""
    port = int(env_url.rsplit(":", 1)[1].split("/")[0])
    manager = folder / "manager.yaml"
    manager.write_text(
        "mode: local\npool_size: 1\n"
        "cluster:\n  base_image: stand-in\n  local:\n    host: 127.0.0.1\n"
        f"  http:\n    port: {port}\n    timeout_s: 100\n    concurrency: 200\n"
        f"    startup_concurrency: {reset_concurrency}\n")
    exp = folder / "exp.yaml"
    exp.write_text("enabled: false\ndir: ./experiences\ntop_k: 1\nmode: template\n")
    return manager, exp


def launcher_argv(a: argparse.Namespace, manager: Path, exp: Path) -> list[str]:
    folder = Path(a.folder)
    port = a.env_url.rsplit(":", 1)[1].split("/")[0]
    return ["launcher.py", "--job-id", "bench", "--manager-config", str(manager), "--exp-config", str(exp),
            "--mode", "local", "--env-config", a.tasks, "--storage-type", "sqlite",
            "--db-path", f"sqlite://{folder / 'original.sqlite'}", "--pool-size", str(a.concurrency),
            "--no-start-local-upstream", "--local-upstream-port", port, "--local-upstream-url", a.env_url,
            "--max-steps", str(a.steps), "--llm-base-url", a.model_url + "/v1", "--llm-api-key", "EMPTY",
            "--llm-model", "stand-in", "--log-dir", str(folder / "original-logs"),
            "--console-log-level", a.log_level, "--file-log-level", a.log_level]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--original", required=True, help="a checkout of BinHuangPJLAB/Safactory")
    p.add_argument("--check", action="store_true", help="only try the imports")
    p.add_argument("--folder", help="the run's folder (configs, its SQLite file, its logs)")
    p.add_argument("--tasks", help="the task file (the same one our load run submits)")
    p.add_argument("--env-url")
    p.add_argument("--model-url")
    p.add_argument("--concurrency", type=int, default=1000)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--reset-concurrency", type=int, default=0, help="cluster.http.startup_concurrency (0: C)")
    p.add_argument("--log-level", default="WARNING", help="its console and file log level")
    a = p.parse_args(argv)
    try:
        launcher = import_original(a.original)
    except Exception as exc:
        print(f"cannot import the original driver from {a.original}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if a.check:
        print(f"original driver importable from {a.original}", flush=True)
        return 0
    folder = Path(a.folder)
    manager, exp = write_configs(folder, a.env_url, a.reset_concurrency or a.concurrency)
    sys.argv = launcher_argv(a, manager, exp)
    os.chdir(folder)
    print("original runner: starting its launcher", flush=True)
    asyncio.run(launcher.main())
    print("original runner: its launcher returned", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
