"""What every command of the command line shares: the setting flags, made from the settings' own
descriptions (broker/settings.py), settings from parsed arguments, and a Redis client (used by
cli, ops, ui, feedcmd, bench).

A command offers the flags of the settings that the parts of the system it runs or reads read
(``reads``: broker/settings.py JOB, WORKER, REDIS, STORE, REDRIVE, FEED, FEED_SERVER), grouped as
the settings are, each with its help, its default and its variable.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys

from broker.settings import ENV_PREFIX, GROUPS, JOB, REDIS, STORE, WORKER, Settings

__all__ = ["SETTING_FLAGS", "LOCAL", "LOCAL_HELPS", "add_command", "add_setting_flags", "add_workers_flag",
           "settings_from_args", "redis_for"]

# The settings that have a flag; flag -> settings field. Every flag is optional and overrides
# the INTERACTOR_* variable.
_FLAGGED = [f for f in dataclasses.fields(Settings) if f.metadata["flag"]]
SETTING_FLAGS = {f.metadata["flag"]: f.name for f in _FLAGGED}
# Setting flags that may be given bare: the value they then stand for.
_BARE = {f.metadata["flag"]: f.metadata["bare"] for f in _FLAGGED if f.metadata["bare"]}

# A command that runs a job, its workers and its consumer on this machine (run, demo, bench).
LOCAL = (JOB, WORKER, REDIS, STORE)
# ... where --concurrency is the total that its local worker processes share.
LOCAL_HELPS = {"--concurrency": "episodes at once in all, split between the local worker processes (--workers); "
                                 "auto[:MIN-MAX]: the job's model calls in flight follow the server "
                                 "(--llm-fleet-max-concurrency auto[:MIN-MAX]), with MAX episodes in all"}


def add_command(sub, name: str, fn, help_: str, reads: tuple[str, ...] = LOCAL,
                helps: dict[str, str] | None = None) -> argparse.ArgumentParser:
    """A command (a parser of the subparsers ``sub``) running ``fn``, with the setting flags of
    the parts it runs or reads."""
    sp = sub.add_parser(name, help=help_, description=help_)
    add_setting_flags(sp, reads, helps)
    sp.set_defaults(fn=fn)
    return sp


def add_setting_flags(p: argparse.ArgumentParser, reads: tuple[str, ...], helps: dict[str, str] | None = None) -> None:
    """The flags of the settings read by the parts in ``reads``, in one argument group per
    settings group; ``helps``: a command's own wording of a flag's help (its default is added)."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for key, about in GROUPS.items():
        for f in _FLAGGED:
            if f.metadata["group"] != key or not f.metadata["read_by"] & set(reads):
                continue
            if key not in groups:
                groups[key] = p.add_argument_group(key, about)
            _add_flag(groups[key], f, (helps or {}).get(f.metadata["flag"], f.metadata["help"]))


def _add_flag(g, f: dataclasses.Field, text: str) -> None:
    m = f.metadata
    flag, shown = m["flag"], _with_default(f, text)
    kind = f.type if isinstance(f.type, str) else f.type.__name__
    if kind == "bool":
        g.add_argument(flag, dest=f.name, action="store_true", default=None, help=shown)
    elif m["bare"]:
        # Bare it stands for its default; with a value only as --flag=VALUE. An optional value
        # (nargs="?") would swallow the next word: `run --tokens tasks.yaml` read tasks.yaml as
        # the mode.
        g.add_argument(flag, dest=f.name, default=None, action="store_const", const=m["bare"], help=shown)
        g.add_argument(_valued(flag), dest=f.name, default=None, help=argparse.SUPPRESS)
    else:
        kw = {}
        if m["typed"]:  # checked when read; the others are checked as their variable is
            kw = {"type": {"int": int, "float": float}.get(kind), "choices": m["choices"] or None}
        metavar = None if kw.get("choices") else _metavar(f, flag, kind)
        g.add_argument(flag, dest=f.name, default=None, metavar=metavar, help=shown, **kw)


def _with_default(f: dataclasses.Field, text: str) -> str:
    """``text (default: D; INTERACTOR_NAME)``, escaped for argparse's %-formatting. A closing
    ``(D: meaning)`` of the text, or ``(unset: meaning)`` of an empty default, says what the
    default means: ``(default: D, meaning; ...)``."""
    d = f.default
    shown = ("on" if d else "off") if isinstance(d, bool) else f"{d:g}" if isinstance(d, float) else str(d)
    means = re.search(r"\s*\((%s): ([^()]*)\)$" % re.escape(shown or "unset"), text)
    if means:
        text, shown = text[:means.start()], f"{shown}, {means[2]}" if shown else means[2]
    names = " or ".join([ENV_PREFIX + f.name.upper()] + ([f.metadata["env"]] if f.metadata["env"] else []))
    return f"{text} (default: {shown or 'none'}; {names})".replace("%", "%%")


def _metavar(f: dataclasses.Field, flag: str, kind: str) -> str:
    if f.name.endswith("_s"):
        return "SECONDS"
    if kind in ("int", "float"):
        return "N" if kind == "int" else "X"
    return "URL" if flag.endswith("-url") else flag[2:].upper().replace("-", "_")


def add_workers_flag(p: argparse.ArgumentParser) -> None:
    """``--workers`` of a command that starts its own worker processes (run, demo, feed serve)."""
    p.add_argument("--workers", type=int, default=None,
                   help="local worker processes (default: one per core); --concurrency is split between them")


def _valued(flag: str) -> str:
    return flag + "-value"


class ArgumentParser(argparse.ArgumentParser):
    """Reads ``--flag=VALUE`` of a flag that may also stand bare (see :func:`add_setting_flags`),
    in the command that has the flag."""

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        out = []
        for a in args:
            flag, eq, value = a.partition("=")
            mine = eq and flag in _BARE and _valued(flag) in self._option_string_actions
            out += [_valued(flag), value] if mine else [a]
        return super().parse_known_args(out, namespace)


def settings_from_args(args: argparse.Namespace) -> Settings:
    """INTERACTOR_* variables, overridden by whichever setting flags were given."""
    overrides = {field: getattr(args, field) for field in SETTING_FLAGS.values() if getattr(args, field, None) is not None}
    if "concurrency" in overrides and not str(overrides["concurrency"]).strip().isdigit():
        _job_concurrency(args, overrides)
    return Settings.from_env(**overrides)


def _job_concurrency(args: argparse.Namespace, overrides: dict) -> None:
    """``--concurrency auto[:MIN-MAX]`` of run (the issue's spelling): the job's fleet-wide model
    concurrency, ``--llm-fleet-max-concurrency``'s value (broker/adaptive.py), and the run's local
    workers get MAX episode slots in all, enough to reach MAX. ``submit`` offers no process flag:
    there it is ``--llm-fleet-max-concurrency auto[:MIN-MAX]``."""
    from broker.adaptive import parse_concurrency
    from broker.settings import SettingsError

    value = str(overrides.pop("concurrency"))
    if not hasattr(args, "llm_fleet_max_concurrency"):
        raise SettingsError(f"--concurrency {value}: auto is a job's setting (its model calls in flight across the "
                            "fleet, following the server: `run --concurrency auto[:MIN-MAX]`, `submit "
                            "--llm-fleet-max-concurrency auto[:MIN-MAX]`); a "
                            "worker's --concurrency is its episodes at once per process: give a number")
    if getattr(args, "llm_fleet_max_concurrency", None) is not None:
        raise SettingsError("give --concurrency auto[:MIN-MAX] or --llm-fleet-max-concurrency, not both")
    try:
        fleet = parse_concurrency(value)
    except ValueError as exc:
        raise SettingsError(f"--concurrency: {exc}") from None
    overrides["llm_fleet_max_concurrency"] = str(fleet)
    if fleet.auto:  # run: its local workers' episode slots
        overrides["concurrency"] = fleet.high


def redis_for(settings: Settings):
    """A client of the fleet's Redis: ``REDIS_URL`` (or ``--redis-url``), else the embedded
    Redis of a local run still running in ``--run-dir`` (``interactor run``, ``feed serve``,
    ``demo``: no password to dig out of its folder)."""
    from broker.redisconn import connect
    from broker.settings import SettingsError

    found = with_local_redis(settings)
    if not found.redis_url:
        # A local run that has stopped: its Redis is started from its folder for this command
        # (interactor/stopped_run.py), so its jobs can still be cancelled, inspected and resumed.
        from interactor.stopped_run import folder_redis

        url = folder_redis(settings)
        if url:
            return connect(settings.replace(redis_url=url))
        raise SettingsError(f"no Redis: set REDIS_URL (or --redis-url), or --run-dir naming the folder of an "
                            f"`interactor run`, `feed serve` or `demo`, running or stopped (none ran in "
                            f"{settings.run_dir}/); the results of a local run are in its folder's results.sqlite "
                            f"(interactor results, jobs)")
    return connect(found)


def with_local_redis(settings: Settings) -> Settings:
    """``settings`` with the URL of the embedded Redis running for ``run_dir``, when no URL is
    set and one runs there."""
    if settings.redis_url:
        return settings
    from pathlib import Path

    from broker.embedded import EmbeddedRedis

    url = EmbeddedRedis.running_url(Path(settings.run_dir) / "redis")
    return settings.replace(redis_url=url) if url else settings
