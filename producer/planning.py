"""Planning a job: its validated task files expanded into episode specs, groups and seeds (no Redis).

Each dataset row of an entry is one task (no dataset = one task, sent ``"dataset": {}`` as the
original system sends it); each task gives ``env_num`` episodes sharing one group. The files are read and checked by ``producer/taskfile.py`` first:
nothing is expanded unless every file is good. :func:`plan_job` only returns the specs;
``producer/enqueue.py`` records and sends them.
"""

from __future__ import annotations

import gc
import hashlib
import logging
import os
import re
from dataclasses import dataclass, field, fields

import msgpack

from broker.caps import LIMIT_ENV_NAMES, LIMIT_ENV_SERVERS, LIMIT_MODEL, server_name
from broker.records import EpisodeSpec
from producer.plaindata import is_flat
from producer.readroots import ReadRoots
from producer.taskfile import TaskFileError, load_task_file

__all__ = ["PlannedJob", "plan_job", "derive_seed"]

# plan_job builds EpisodeSpec positionally for speed; fail loudly if the schema's order moves.
_SPEC_ORDER = ("job_id", "episode_id", "group_id", "group_size", "env_name", "base_url",
               "env_params", "seed", "queue", "source", "transport", "env_class", "image", "sampling")
if tuple(f.name for f in fields(EpisodeSpec))[:len(_SPEC_ORDER)] != _SPEC_ORDER:
    raise ImportError("broker.records.EpisodeSpec field order changed; update producer.planning._expand")

log = logging.getLogger("interactor.producer")

_JOB_ID_RE = re.compile(r"[A-Za-z0-9_\-]+")
_SEED_MOD = 2**31


@dataclass
class PlannedJob:
    episodes: list[EpisodeSpec]
    groups: int
    sources: list[str]  # absolute task file paths, in the order given
    by_env: dict[str, int] = field(default_factory=dict)  # env_name -> episode count
    tokens: str | None = None  # the task files' "tokens" (None: none said)
    limits: dict | None = None  # the task files' "limits", merged and checked (None: none said)
    pause_after_failures: int | None = None  # the task files' (None: none said)
    resume: bool | None = None  # the task files' "resume" (None: none said)
    cache: str | None = None  # the task files' "cache" (broker/cache.py; None: none said)
    warnings: list[str] = field(default_factory=list)  # what the files' check let pass: keys ignored, ...


def derive_seed(base: int, file_name: str, entry: int, row: int, k: int) -> int:
    """The default seed of one episode: stable across reruns (no job id), in [0, 2**31)."""
    h = hashlib.blake2b(f"{base}\x1f{file_name}\x1f{entry}\x1f{row}\x1f{k}".encode(), digest_size=8)
    return int.from_bytes(h.digest(), "big") % _SEED_MOD


def plan_job(paths: list[str], *, job_id: str, default_base_url: str = "",
             default_queue: str = "episodes", roots: ReadRoots | None = None) -> PlannedJob:
    """Validate every task file, then expand them into episode specs (no Redis).

    IDs: group ``{job_id}.{f}.{e}.{r}``, episode ``{group_id}.{k}`` (all 1-based: file in
    ``paths``, entry, dataset row, repeat). Seeds derive from (entry seed or 0, file basename,
    e, r, k) unless the entry says ``seed: null``. ``roots``: see ``producer.taskfile.load_task_file``.
    """
    if not isinstance(job_id, str) or not _JOB_ID_RE.fullmatch(job_id):
        raise ValueError(f"job_id must match [A-Za-z0-9_-]+, got {job_id!r}")
    if isinstance(paths, (str, bytes, os.PathLike)):
        paths = [paths]  # a lone path is an easy mistake; don't iterate its characters
    paths = [os.fspath(p) for p in paths]
    if not paths:
        raise TaskFileError("no task files given")

    gc_was_enabled = gc.isenabled()
    gc.disable()  # ~10 acyclic objects per episode and row: GC passes only cost time here
    try:
        # Validate the whole set first: nothing is returned unless every file is good.
        metas = [{} for _ in paths]
        loaded = [load_task_file(p, default_base_url=default_base_url, default_queue=default_queue, meta=m,
                                 roots=roots)
                  for p, m in zip(paths, metas)]
        said = {m["tokens"] for m in metas if "tokens" in m}
        if len(said) > 1:  # one job, one way of asking the model server
            raise TaskFileError(f"the task files disagree on 'tokens': {sorted(said)}")
        limits = _merge_limits(paths, metas, loaded)
        pauses = {m["pause_after_failures"] for m in metas if "pause_after_failures" in m}
        if len(pauses) > 1:
            raise TaskFileError(f"the task files disagree on 'pause_after_failures': {sorted(pauses)}")
        resumes = {m["resume"] for m in metas if "resume" in m}
        if len(resumes) > 1:
            raise TaskFileError("the task files disagree on 'resume': one says true, another false")
        caches = {m["cache"] for m in metas if "cache" in m}
        if len(caches) > 1:
            raise TaskFileError(f"the task files disagree on 'cache': {sorted(caches)}")
        episodes, groups, by_env = _expand(paths, loaded, job_id)
    finally:
        if gc_was_enabled:
            gc.enable()

    warnings = [w for m in metas for w in m.get("warnings", ())]
    for w in warnings:
        log.warning("%s", w)
    return PlannedJob(episodes=episodes, groups=groups, sources=[os.path.abspath(p) for p in paths],
                      by_env=by_env, tokens=said.pop() if said else None, limits=limits,
                      pause_after_failures=pauses.pop() if pauses else None,
                      resume=resumes.pop() if resumes else None, cache=caches.pop() if caches else None,
                      warnings=warnings)


def _merge_limits(paths: list[str], metas: list[dict], loaded: list[list[dict]]) -> dict | None:
    """The task files' ``limits`` as one mapping. Every env server and env_name a cap names
    must be one an entry of the job uses (a typo would cap nothing, silently); two files may
    name the same cap only with the same value."""
    servers = {server_name(ent["base_url"]) for entries in loaded for ent in entries if ent["transport"] == "http"}
    names = {ent["env_name"] for entries in loaded for ent in entries if ent["transport"] == "http"}
    merged: dict = {}
    said = False
    for path, meta in zip(paths, metas):
        raw = meta.get("limits")
        if raw is None:
            continue
        said = True
        for section, value in raw.items():
            entries = {"": value} if section == LIMIT_MODEL else value
            for name, caps in entries.items():
                if section == LIMIT_ENV_SERVERS:
                    name = server_name(name)
                    if name not in servers:
                        raise TaskFileError(f"{path}: 'limits': env_servers {name!r} matches no entry's base_url "
                                            f"(the job's env servers: {', '.join(sorted(servers)) or 'none'})")
                elif section == LIMIT_ENV_NAMES and name not in names:
                    raise TaskFileError(f"{path}: 'limits': env_names {name!r} matches no entry's env_name "
                                        f"(the job's http env names: {', '.join(sorted(names)) or 'none'})")
                have = merged.setdefault(section, {}).setdefault(name, {}) if name else merged.setdefault(section, {})
                for k, n in caps.items():
                    if have.get(k, n) != n:
                        raise TaskFileError(f"the task files disagree on 'limits' {section} {name!r} {k}: "
                                            f"{have[k]} and {n}")
                    have[k] = n
    return merged if said else None


def _expand(paths: list[str], loaded: list[list[dict]], job_id: str
            ) -> tuple[list[EpisodeSpec], int, dict[str, int]]:
    episodes: list[EpisodeSpec] = []
    append = episodes.append
    by_env: dict[str, int] = {}
    groups = 0
    blake2b, from_bytes, Spec = hashlib.blake2b, int.from_bytes, EpisodeSpec
    unpackb = msgpack.unpackb
    for f, (path, entries) in enumerate(zip(paths, loaded), 1):
        file_name = os.path.basename(path)
        for ent in entries:
            e, name, params, n = ent["index"], ent["env_name"], ent["env_params"], ent["env_num"]
            base_url, queue, seed_base, rows = ent["base_url"], ent["queue"], ent["seed"], ent["rows"]
            transport, env_class, image = ent["transport"], ent["env_class"], ent["image"]
            sampling = ent.get("sampling") or {}
            agent, agent_command = ent.get("agent", ""), ent.get("agent_command") or []
            env_calls_model = ent.get("env_calls_model", False)
            protocol, mapping = ent.get("protocol", ""), ent.get("mapping") or {}
            # An entry without a dataset sends "dataset": {}, as the original system does (an env
            # whose constructor defaults dataset=None sees what it saw there); an own "dataset"
            # in its env_params is sent as written.
            no_row = None if rows is not None or "dataset" in params else {}
            # Each episode gets its own params: a shallow copy when nothing nested, else a
            # msgpack round-trip (a fast deep copy of JSON data; tuples come back as lists, as
            # they would from the ledger). No pickle anywhere.
            blob = None if is_flat(params) else msgpack.packb(params, use_bin_type=True)
            tasks = rows if rows is not None else (None,)
            entry_src = f"{path} entry {e}"
            for r, row in enumerate(tasks, 1):
                group_id = f"{job_id}.{f}.{e}.{r}"
                source = entry_src if row is None else f"{entry_src} row {r}"
                # Same bytes as derive_seed(), with the shared prefix hashed once per task.
                prefix = None if seed_base is None else blake2b(
                    f"{seed_base}\x1f{file_name}\x1f{e}\x1f{r}\x1f".encode(), digest_size=8)
                for k in range(1, n + 1):
                    p = dict(params) if blob is None else unpackb(blob, raw=False, strict_map_key=False)
                    if row is not None:
                        p["dataset"] = row  # shared within its group only, never across groups
                    elif no_row is not None:
                        p["dataset"] = {}
                    if prefix is None:
                        seed = None
                    else:
                        h = prefix.copy()
                        h.update(b"%d" % k)
                        seed = from_bytes(h.digest(), "big") % _SEED_MOD
                    # positional (checked against the schema at import): ~2x faster than kwargs
                    append(Spec(job_id, f"{group_id}.{k}", group_id, n, name, base_url, p,
                                seed, queue, source, transport, env_class, image, sampling))
                    if protocol:
                        spec = episodes[-1]
                        spec.protocol, spec.mapping = protocol, mapping
                    if agent or agent_command or env_calls_model:
                        spec = episodes[-1]
                        spec.agent, spec.agent_command, spec.env_calls_model = agent, list(agent_command), env_calls_model
            groups += len(tasks)
            by_env[name] = by_env.get(name, 0) + n * len(tasks)
    return episodes, groups, by_env
