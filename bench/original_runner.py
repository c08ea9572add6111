"""Runs the original driver (BinHuangPJLAB/Safactory, from a checkout) against the bench's stand-ins.

The original's side of the comparison in bench/original_driver.py.

Run as a script, never imported by the rest of the bench: the original's top-level names
(``interactor``, ``env``, ``core``, ``manager``, ``utils``) must resolve to the checkout, so this
file puts the checkout first on ``sys.path`` and imports nothing of ours. Nothing of the original
is copied here. It is run with the interpreter of a venv that holds the original's dependencies
(``--original-python`` of the bench), in one of two setups (``--setup``):

* ``interactor`` (the default): the original's ``Interactor``, unmodified, driven directly as the
  reference driver of issue 49 drives it (``../shared/bench/original_driver_reference.py``): its
  real ``DataManager`` (SQLite, write buffer on, the launcher's constructor arguments: buffer 100,
  flush every 5 s), ``StaticBaseURLProvider``, the reference's ``Interactor`` arguments
  (temperature 0.3, ``message_cut`` 3, env timeout 300 s, 2 HTTP retries, C workers), and a
  minimal pool (``TaskPool``): it hands out the task file's episodes in order, read by the
  original's own ``load_yaml_configs``, resets each instance in the worker's slot (``acquire``)
  and deletes it there (``done``), as the reference's ``CountdownPool`` does. Before the
  episodes start, C keep-alive connections are opened in each of its three aiohttp sessions
  (``prewarm``, a few at a time, as the reference does). Logging: Python's default (nothing
  below WARNING is ever formatted) unless ``--log-level`` names a level, which sets up the
  launcher's logging (``log_setup.setup_launcher_logging``) at that level.
* ``launcher``: the original's ``launcher.py`` as its launcher runs it (``python launcher.py
  --mode local ...``): the task file's rows go into its SQLite table (``sync_configs_to_db``),
  its pool manager (``EnvPoolManager`` behind the launcher's ``ManagerActorPool``) resets C x
  1.2 env instances ahead and, as an episode ends, closes it and resets the next row's instance
  in a background task, its ``Interactor`` drives C episodes with the launcher's defaults
  (``message_cut`` -1), and its logging is set up at ``--log-level`` (WARNING for ``none``):
  the root logger at DEBUG, so every debug and info call of the step path makes a record that
  the handlers then drop. Two import shims, both for code the run never executes, are printed
  when used: ``wandb`` (imported by ``rl/utils/metrics.py`` through ``utils``) and
  ``env.env_factory`` (at the checkout's HEAD it imports a name ``env/registry.py`` does not
  define; ``manager/actor_pool.py`` uses it only for in-process envs).

``--check`` only tries the setup's imports (exit 0, or 1 with the reason on stderr).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import types
import uuid
from pathlib import Path

SETUPS = ("interactor", "launcher")


def _shim(name: str, module: types.ModuleType, why: str) -> None:
    sys.modules[name] = module
    print(f"original runner: shim for {name} ({why})", file=sys.stderr, flush=True)


def _put_first(path: str) -> None:
    here = str(Path(__file__).resolve().parent)
    sys.path[:] = [p for p in sys.path if p not in ("", here, os.getcwd())]
    sys.path.insert(0, path)


def import_launcher(path: str):
    """Import the original's launcher from ``path``; return the module."""
    _put_first(path)
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


def import_interactor(path: str) -> types.SimpleNamespace:
    """Import what the ``interactor`` setup runs of the original from ``path`` (no shims)."""
    _put_first(path)
    import aiohttp
    from core.data_manager.load_yaml import load_yaml_configs
    from core.data_manager.manager import DataManager
    from core.llm import StaticBaseURLProvider
    from interactor import ActorHandle, Interactor

    return types.SimpleNamespace(aiohttp=aiohttp, ActorHandle=ActorHandle, Interactor=Interactor,
                                 DataManager=DataManager, StaticBaseURLProvider=StaticBaseURLProvider,
                                 load_yaml_configs=load_yaml_configs)


# --------------------------------------------------------------------------- the interactor setup


class TaskPool:
    """The ``ActorPool`` the original's ``Interactor`` takes, over the task file's episodes: each
    ``acquire`` resets a fresh instance of the next one (in the worker's slot, as the reference's
    ``CountdownPool``), ``done`` deletes it; ``None`` once all are handed out."""

    def __init__(self, orig: types.SimpleNamespace, configs: list[dict], env_url: str, pool_size: int):
        self.orig = orig
        self.pool_size = int(pool_size)
        self.base_url = env_url.rstrip("/")
        # (config, group id) per episode; the group id as the launcher's sync_configs_to_db makes it
        self._episodes = ((c, str(uuid.uuid5(uuid.NAMESPACE_OID, f"{c['env_name']}:{c.get('task_idx', 1)}")))
                          for c in configs for _ in range(int(c.get("env_num", 1) or 1)))
        self.session = None
        self.handed_out = 0

    async def start(self) -> None:
        if self.session is None:
            aiohttp = self.orig.aiohttp
            self.session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=max(64, self.pool_size * 2), limit_per_host=0),
                timeout=aiohttp.ClientTimeout(total=300))  # the launcher's env_http_timeout_s

    async def acquire(self):
        item = next(self._episodes, None)  # no await before it: one episode per call under asyncio
        if item is None:
            return None
        cfg, group_id = item
        name, env_id, seed = cfg["env_name"], str(uuid.uuid4()), self.handed_out
        self.handed_out += 1
        async with self.session.post(f"{self.base_url}/{name}/{env_id}/reset",
                                     json={"env_param": cfg.get("env_params") or {}, "seed": seed}) as r:
            r.raise_for_status()
            await r.read()
        return self.orig.ActorHandle(env_name=name, env_id=env_id, group_id=group_id, transport="http",
                                     base_url=self.base_url)

    async def done(self, actor) -> None:
        async with self.session.delete(f"{self.base_url}/{actor.env_name}/{actor.env_id}") as r:
            await r.read()

    async def aclose(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None


async def prewarm(orig: types.SimpleNamespace, session, url: str, n: int, batch: int = 4) -> int:
    """Open ``n`` keep-alive connections to ``url``'s host in an aiohttp session's pool, ``batch``
    at a time, without a request (aiohttp's connector API, as the reference driver does)."""
    from yarl import URL

    aiohttp = orig.aiohttp
    loop = asyncio.get_running_loop()
    held = []
    for i in range(0, n, batch):
        reqs = [aiohttp.ClientRequest("GET", URL(url), loop=loop, ssl=True, proxy=None)
                for _ in range(min(batch, n - i))]
        held += await asyncio.gather(*[session.connector.connect(r, [], aiohttp.ClientTimeout(total=30))
                                       for r in reqs])
        await asyncio.sleep(0.01)
    for c in held:
        c.release()
    return len(held)


async def run_interactor(a: argparse.Namespace, orig: types.SimpleNamespace) -> None:
    """The ``interactor`` setup: the original's ``Interactor`` over ``TaskPool`` until the pool
    is exhausted (the bench stops it after its window)."""
    folder = Path(a.folder)
    if a.log_level.lower() != "none":
        from log_setup import setup_launcher_logging

        setup_launcher_logging(log_dir=str(folder / "original-logs"), run_name="bench", console_level=a.log_level,
                               file_level=a.log_level, max_bytes=50 * 1024 * 1024, backup_count=20)
    data_manager = orig.DataManager(job_id=uuid.uuid4().hex, storage_type="sqlite",
                                    db_url=f"sqlite://{folder / 'original.sqlite'}",
                                    enable_buffer=True, buffer_size=100, flush_interval=5.0)
    await data_manager.init()  # the launcher's sync_configs_to_db does this
    pool = TaskPool(orig, orig.load_yaml_configs(a.tasks), a.env_url, a.concurrency)
    interactor = orig.Interactor(
        pool=pool, base_url_provider=orig.StaticBaseURLProvider(base_url=a.model_url + "/v1"), api_key="EMPTY",
        model="stand-in", data_manager=data_manager, temperature=0.3, max_steps=1000, message_cut=3,
        env_http_timeout_s=300.0, max_workers=a.concurrency, http_retries=2, verbose=True)
    try:
        # run_all_environments() starts these too; they are no-ops once started
        await interactor.http.start()
        await interactor.llm_http.start()
        await pool.start()
        if a.prewarm:
            n = [await prewarm(orig, interactor.http._session, a.env_url, a.concurrency),
                 await prewarm(orig, interactor.llm_http._session, a.model_url + "/v1", a.concurrency),
                 await prewarm(orig, pool.session, a.env_url, a.concurrency)]
            print(f"original runner: prewarmed {n} connections (env, model, pool)", flush=True)
        print("original runner: starting its Interactor", flush=True)
        await interactor.run_all_environments()
    finally:
        await interactor.aclose()
        await pool.aclose()
        await data_manager.close()


# --------------------------------------------------------------------------- the launcher setup


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
    level = "WARNING" if a.log_level.lower() == "none" else a.log_level
    return ["launcher.py", "--job-id", "bench", "--manager-config", str(manager), "--exp-config", str(exp),
            "--mode", "local", "--env-config", a.tasks, "--storage-type", "sqlite",
            "--db-path", f"sqlite://{folder / 'original.sqlite'}", "--pool-size", str(a.concurrency),
            "--no-start-local-upstream", "--local-upstream-port", port, "--local-upstream-url", a.env_url,
            "--max-steps", str(a.steps), "--llm-base-url", a.model_url + "/v1", "--llm-api-key", "EMPTY",
            "--llm-model", "stand-in", "--log-dir", str(folder / "original-logs"),
            "--console-log-level", level, "--file-log-level", level]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--original", required=True, help="a checkout of BinHuangPJLAB/Safactory")
    p.add_argument("--setup", choices=SETUPS, default="interactor",
                   help="interactor: its Interactor driven directly, as the reference driver; launcher: its launcher.py")
    p.add_argument("--check", action="store_true", help="only try the imports")
    p.add_argument("--folder", help="the run's folder (configs, its SQLite file, its logs)")
    p.add_argument("--tasks", help="the task file (the same one our load run submits)")
    p.add_argument("--env-url")
    p.add_argument("--model-url")
    p.add_argument("--concurrency", type=int, default=1000)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--reset-concurrency", type=int, default=0,
                   help="launcher setup: cluster.http.startup_concurrency (0: C)")
    p.add_argument("--log-level", default="none",
                   help="none (interactor setup: Python's default logging; launcher setup: WARNING) or a level "
                        "for the launcher's logging setup, console and file")
    p.add_argument("--no-prewarm", dest="prewarm", action="store_false",
                   help="interactor setup: connect as the episodes start instead")
    a = p.parse_args(argv)
    try:
        orig = import_launcher(a.original) if a.setup == "launcher" else import_interactor(a.original)
    except Exception as exc:
        print(f"cannot import the original driver from {a.original}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if a.check:
        print(f"original driver importable from {a.original} ({a.setup} setup)", flush=True)
        return 0
    folder = Path(a.folder)
    if a.setup == "interactor":
        os.chdir(folder)
        asyncio.run(run_interactor(a, orig))
        print("original runner: its Interactor returned", flush=True)
        return 0
    manager, exp = write_configs(folder, a.env_url, a.reset_concurrency or a.concurrency)
    sys.argv = launcher_argv(a, manager, exp)
    os.chdir(folder)
    print("original runner: starting its launcher", flush=True)
    asyncio.run(orig.main())
    print("original runner: its launcher returned", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
