"""Task files (docs/protocol.md#task-files): read, validate and expand them into episode specs.

A task file is YAML::

    environments:
      - env_name: sokoban            # letters, digits, "_", "-", "."
        env_params: {level: 3}       # mapping, default {}
        dataset: data/puzzles.jsonl  # optional: path (.json/.jsonl/.yaml/.yml/.parquet) or inline list
        env_num: 4                   # episodes per task (the GRPO group size), default 1
        base_url: http://env:8000    # optional; else the producer's default
        seed: 7                      # optional; int base for derived seeds, or null = env chooses
        queue: episodes              # optional; else the producer's default

An entry may instead name an environment class that the worker runs in its own process::

      - env_name: textarena.GuessTheNumber-v0
        transport: inproc                                      # "http" (default) or "inproc"
        env_class: envs.textarena_env:TextArenaEnv  # "module:Class"; implies inproc

Such an entry needs no base_url (one given explicitly is an error). Only the shape
``module:Class`` is checked here: workers share no files with the producer, so whether the
class imports is for the worker to find out (``env_bad_request`` if it does not).

Each dataset row is one task (no dataset = one task); each task gives ``env_num`` episodes
sharing one group. Nothing here touches Redis: :func:`plan_job` only returns the specs.

Everything is validated before anything is returned. Errors are :class:`TaskFileError`, whose
message names the file, the entry (1-based), the row (1-based) and the field at fault.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import re
from dataclasses import dataclass, field, fields
from typing import Any
import msgpack
import yaml

from broker.caps import LIMIT_ENV_NAMES, LIMIT_ENV_SERVERS, LIMIT_MODEL, check_limits, server_name
from broker.records import EpisodeSpec
from broker.settings import redact_url
from broker.tokens import TOKEN_MODES, TOKENS_AUTO
from broker.urls import url_problem
from envs.base import valid_object_path
from producer.readroots import OutsideRoots, ReadRoots

__all__ = ["TaskFileError", "PlannedJob", "plan_job", "load_task_file", "derive_seed", "DATASET_FORMATS"]

DATASET_FORMATS = (".json", ".jsonl", ".yaml", ".yml", ".parquet")
ENTRY_KEYS = ("env_name", "env_params", "dataset", "env_num", "base_url", "seed", "queue", "transport",
              "env_class")
TRANSPORTS = ("http", "inproc")
# "tokens" (optional): ask the model server for token ids and logprobs (broker/tokens.py
# TOKEN_MODES; true = "auto"); the job's setting, unless the command line set one.
# "limits" (optional): fleet-wide caps (broker/caps.py check_limits), their names checked
# against the entries; "pause_after_failures" (optional): the job pauses after that many
# episodes in a row failed alike (broker/pause.py; 0 = never).
TOP_KEYS = ("environments", "tokens", "limits", "pause_after_failures")

# plan_job builds EpisodeSpec positionally for speed; fail loudly if the schema's order moves.
_SPEC_ORDER = ("job_id", "episode_id", "group_id", "group_size", "env_name", "base_url",
               "env_params", "seed", "queue", "source", "transport", "env_class")
if tuple(f.name for f in fields(EpisodeSpec))[:len(_SPEC_ORDER)] != _SPEC_ORDER:
    raise ImportError("broker.records.EpisodeSpec field order changed; update producer.taskfile._expand")

_ENV_NAME_RE = re.compile(r"[A-Za-z0-9_.\-]+")
_JOB_ID_RE = re.compile(r"[A-Za-z0-9_\-]+")
_SEED_MOD = 2**31
_INT_MIN, _UINT_MAX = -(2**63), 2**64 - 1  # what msgpack can carry
_LONG_DIGITS = re.compile(r"[0-9]{19}")  # an integer outside 64 bits has at least 19 digits
_ABSENT = object()


class TaskFileError(ValueError):
    """A task file or dataset that cannot be used; the message says where and why."""


@dataclass
class PlannedJob:
    episodes: list[EpisodeSpec]
    groups: int
    sources: list[str]  # absolute task file paths, in the order given
    by_env: dict[str, int] = field(default_factory=dict)  # env_name -> episode count
    tokens: str | None = None  # the task files' "tokens" (None: none said)
    limits: dict | None = None  # the task files' "limits", merged and checked (None: none said)
    pause_after_failures: int | None = None  # the task files' (None: none said)


# --------------------------------------------------------------------------- YAML loading

_YAMLBase = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _Loader(_YAMLBase):  # type: ignore[misc, valid-type]
    """Safe loader that keeps timestamps as strings and rejects duplicate mapping keys.

    ``2024-01-01`` would otherwise become a ``datetime.date``, which neither msgpack nor
    JSON can carry to a worker or an env; a duplicated key (``env_num`` twice) would
    otherwise silently keep the last value.
    """

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: set = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # "<<: *base" then overriding a key is legitimate
                key = self.construct_object(key_node, deep=True)
                try:
                    dup = key in seen
                except TypeError:
                    continue  # unhashable key: the base class reports it
                if dup:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping", node.start_mark,
                        f"found duplicate key {key!r}", key_node.start_mark)
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in _YAMLBase.yaml_implicit_resolvers.items()
}


def _yaml_error(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    if mark is not None:
        return f"line {mark.line + 1} column {mark.column + 1}: {problem}"
    return str(exc).replace("\n", " ")


def _load_yaml(path: str) -> tuple[Any, yaml.Node | None]:
    """Parse one YAML document; return (data, root node) so callers can report lines."""
    with open(path, "rb") as fh:
        loader = _Loader(fh)
        try:
            node = loader.get_single_node()
            data = loader.construct_document(node) if node is not None else None
        finally:
            loader.dispose()
    return data, node


# --------------------------------------------------------------------------- values

def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_plain(v: Any, where: str) -> str | None:
    """Return None if ``v`` is plain JSON data (str-keyed maps, lists, scalars), else a
    description of the first offending place. Specs travel as msgpack and reach the env as
    JSON, so dates, bytes, sets, Decimals or non-string keys must be caught here."""
    if v is None or isinstance(v, (str, bool)):
        return None
    if isinstance(v, int):
        # Specs travel as msgpack, whose integers are 64 bits: a larger one cannot be sent.
        if _INT_MIN <= v <= _UINT_MAX:
            return None
        return f"{where}: the integer {v} does not fit in 64 bits (write it as a string)"
    if isinstance(v, float):
        return None  # NaN/inf included: msgpack and Python's json both carry them
    if isinstance(v, dict):
        for k, x in v.items():
            if not isinstance(k, str):
                return f"{where}: key {k!r} is a {type(k).__name__}; keys must be strings"
            bad = _check_plain(x, f"{where}.{k}")
            if bad:
                return bad
        return None
    if isinstance(v, (list, tuple)):
        for i, x in enumerate(v):
            bad = _check_plain(x, f"{where}[{i}]")
            if bad:
                return bad
        return None
    return f"{where}: a {type(v).__name__} value ({v!r:.60}) cannot be sent to an env as JSON"


def _copy_tree(v: Any) -> Any:
    """Deep copy of plain JSON data (much faster than copy.deepcopy)."""
    if isinstance(v, dict):
        return {k: _copy_tree(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_copy_tree(x) for x in v]
    return v


def _is_flat(d: dict) -> bool:
    return not any(isinstance(x, (dict, list, tuple)) for x in d.values())


def derive_seed(base: int, file_name: str, entry: int, row: int, k: int) -> int:
    """The default seed of one episode: stable across reruns (no job id), in [0, 2**31)."""
    h = hashlib.blake2b(f"{base}\x1f{file_name}\x1f{entry}\x1f{row}\x1f{k}".encode(), digest_size=8)
    return int.from_bytes(h.digest(), "big") % _SEED_MOD


# --------------------------------------------------------------------------- datasets

class _DatasetError(Exception):
    """Raised inside dataset readers; the caller adds file/entry context."""

    def __init__(self, msg: str, row: int | None = None):
        super().__init__(msg)
        self.row = row


def _rows_from_list(data: Any, what: str) -> list[dict]:
    if not isinstance(data, list):
        raise _DatasetError(f"{what} must be a list of rows, got {type(data).__name__}")
    for i, row in enumerate(data, 1):
        if not isinstance(row, dict):
            raise _DatasetError(f"row must be a mapping, got {type(row).__name__}", row=i)
    return data


def _read_jsonl(path: str) -> list[dict]:
    rows: list[dict] = []
    loads = json.loads
    with open(path, "r", encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = loads(line)
            except ValueError as exc:  # JSONDecodeError
                raise _DatasetError(f"line {lineno}: invalid JSON: {exc}", row=len(rows) + 1) from None
            if not isinstance(row, dict):
                raise _DatasetError(f"line {lineno}: row must be a JSON object, got {type(row).__name__}",
                                    row=len(rows) + 1)
            if _LONG_DIGITS.search(line):  # rarely: only then is the row walked for a too-large integer
                bad = _check_plain(row, "dataset")
                if bad:
                    raise _DatasetError(f"line {lineno}: {bad}", row=len(rows) + 1)
            rows.append(row)
    return rows


def _read_json(path: str) -> list[dict]:
    with open(path, "r", encoding="utf-8") as fh:
        text = fh.read()
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise _DatasetError(f"invalid JSON: {exc}") from None
    rows = _rows_from_list(data, "a .json dataset")
    if _LONG_DIGITS.search(text):
        for r, row in enumerate(rows, 1):
            bad = _check_plain(row, "dataset")
            if bad:
                raise _DatasetError(bad, row=r)
    return rows


def _read_yaml(path: str) -> list[dict]:
    try:
        data, _ = _load_yaml(path)
    except yaml.YAMLError as exc:
        raise _DatasetError(f"not valid YAML: {_yaml_error(exc)}") from None
    return _rows_from_list(data, "a YAML dataset")


def _read_parquet(path: str) -> list[dict]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid, OSError, ...
        raise _DatasetError(f"cannot read Parquet: {type(exc).__name__}: {exc}") from None
    return table.to_pylist()


_READERS = {".json": _read_json, ".jsonl": _read_jsonl, ".yaml": _read_yaml, ".yml": _read_yaml,
            ".parquet": _read_parquet}


# --------------------------------------------------------------------------- task files

def load_task_file(path, *, default_base_url: str = "", default_queue: str = "episodes",
                   meta: dict | None = None, roots: ReadRoots | None = None) -> list[dict]:
    """Parse and validate one task file. Returns one normalized dict per entry::

        {"index": e, "line": yaml_line, "env_name": str, "env_params": dict, "env_num": int,
         "base_url": str ("" for inproc), "seed": int | None (None = explicit null), "queue": str,
         "rows": list[dict] | None (None = no dataset), "dataset": abs path | "<inline>" | None,
         "transport": "http" | "inproc", "env_class": "module:Class" | ""}

    Raises :class:`TaskFileError` naming file, entry, row and field. With ``roots`` (a path a
    request named), the file and its datasets are read only inside them, by their resolved paths.
    """
    path = os.fspath(path)
    if roots is not None:
        try:
            path = roots.resolve(path, "task file")
        except OutsideRoots as exc:
            raise TaskFileError(str(exc)) from None
    if not os.path.isfile(path):
        raise TaskFileError(f"{path}: task file not found" if not os.path.exists(path)
                            else f"{path}: not a regular file")
    try:
        doc, root = _load_yaml(path)
    except yaml.YAMLError as exc:
        raise TaskFileError(f"{path}: not valid YAML: {_yaml_error(exc)}") from None
    except OSError as exc:
        raise TaskFileError(f"{path}: cannot read: {exc}") from None

    if not isinstance(doc, dict):
        got = "an empty file" if doc is None else f"a {type(doc).__name__}"
        raise TaskFileError(f"{path}: top level must be a mapping with key 'environments', got {got}")
    for key in doc:
        if key not in TOP_KEYS:
            raise TaskFileError(f"{path}: unknown top-level key {key!r} (allowed: {', '.join(TOP_KEYS)})")
    envs = doc.get("environments")
    if envs is None:
        raise TaskFileError(f"{path}: missing key 'environments' (a non-empty list of entries)")
    if not isinstance(envs, list) or not envs:
        raise TaskFileError(f"{path}: 'environments' must be a non-empty list of entries")

    lines: list[int | None] = [None] * len(envs)
    if isinstance(root, yaml.MappingNode):
        for k_node, v_node in root.value:
            if getattr(k_node, "value", None) == "environments" and isinstance(v_node, yaml.SequenceNode):
                lines = [n.start_mark.line + 1 for n in v_node.value]
    if "tokens" in doc:
        tokens = doc["tokens"]
        if tokens is True:
            tokens = TOKENS_AUTO
        elif tokens is False or tokens is None:
            tokens = ""
        if tokens not in TOKEN_MODES:
            raise TaskFileError(f"{path}: 'tokens' must be true, false or one of "
                                f"{', '.join(m for m in TOKEN_MODES if m)}, got {doc['tokens']!r}")
        if meta is not None:
            meta["tokens"] = tokens
    if "limits" in doc:
        problem = check_limits(doc["limits"])
        if problem:
            raise TaskFileError(f"{path}: 'limits': {problem}")
        if meta is not None:
            meta["limits"] = doc["limits"]
    if "pause_after_failures" in doc:
        n = doc["pause_after_failures"]
        if not _is_int(n) or n < 0:
            raise TaskFileError(f"{path}: 'pause_after_failures' must be an integer >= 0 (0 = never pause), got {n!r}")
        if meta is not None:
            meta["pause_after_failures"] = n
    base_dir = os.path.dirname(os.path.abspath(path))
    return [_load_entry(path, base_dir, e, raw, lines[e - 1] if e - 1 < len(lines) else None,
                        default_base_url, default_queue, roots)
            for e, raw in enumerate(envs, 1)]


def _load_entry(path: str, base_dir: str, e: int, raw: Any, line: int | None,
                default_base_url: str, default_queue: str, roots: ReadRoots | None = None) -> dict:
    at_line = f" (line {line})" if line else ""
    at = f"{path}: entry {e}{at_line}"

    def fail(fld: str, msg: str, row: int | None = None) -> TaskFileError:
        where = at + (f" row {row}" if row is not None else "")
        return TaskFileError(f"{where}: field {fld!r}: {msg}")

    if not isinstance(raw, dict):
        raise TaskFileError(f"{at}: an entry must be a mapping, got {type(raw).__name__}")
    for key in raw:
        if key not in ENTRY_KEYS:
            raise TaskFileError(f"{at}: unknown key {key!r} (allowed: {', '.join(ENTRY_KEYS)})")

    name = raw.get("env_name")
    if name is None:
        raise fail("env_name", "missing (a non-empty string)")
    if not isinstance(name, str) or not _ENV_NAME_RE.fullmatch(name):
        raise fail("env_name", f"must be a non-empty string of letters, digits, '_', '-', '.'; got {name!r}")
    at = f"{path}: entry {e} ({name}" + (f", line {line})" if line else ")")

    params = raw.get("env_params", {})
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise fail("env_params", f"must be a mapping, got {type(params).__name__}")
    bad = _check_plain(params, "env_params")
    if bad:
        raise fail("env_params", bad)

    env_num = raw.get("env_num", 1)
    if not _is_int(env_num) or env_num < 1:
        raise fail("env_num", f"must be an integer >= 1, got {env_num!r}")

    env_class = raw.get("env_class", _ABSENT)
    transport = raw.get("transport", _ABSENT)
    if transport is _ABSENT:
        transport = "http" if env_class is _ABSENT else "inproc"
    if transport not in TRANSPORTS:
        raise fail("transport", f"must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
    if transport == "inproc":
        if env_class is _ABSENT or env_class is None:
            raise fail("env_class", "missing: transport inproc needs an environment class 'module:Class'")
        if not valid_object_path(env_class):
            raise fail("env_class", f"must be 'module:Class' (e.g. 'mypkg.envs:MyEnv'), got {env_class!r}")
        if raw.get("base_url", _ABSENT) is not _ABSENT:
            raise fail("base_url", "not used with transport inproc (the worker runs env_class itself); remove it")
        base_url = ""
    else:
        if env_class is not _ABSENT:
            raise fail("env_class", "only used with transport inproc (remove it, or say transport: inproc)")
        env_class = ""
        base_url = raw.get("base_url", _ABSENT)
        if base_url is _ABSENT or base_url is None:
            if not default_base_url:
                raise fail("base_url", "missing, and no default env base URL was given")
            base_url, from_default = default_base_url, True
        else:
            from_default = False
        # The check workers repeat before any call (broker/urls.py): refused here, at submit.
        problem = url_problem(base_url)
        if problem:
            src = " (the default)" if from_default else ""
            shown = redact_url(base_url) if isinstance(base_url, str) else base_url
            raise fail("base_url", f"not an accepted http(s) URL{src}: {problem}; got {shown!r}")

    seed = raw.get("seed", _ABSENT)
    if seed is _ABSENT:
        seed = 0
    elif seed is not None and not _is_int(seed):
        raise fail("seed", f"must be an integer or null, got {seed!r}")

    queue = raw.get("queue", _ABSENT)
    if queue is _ABSENT:
        queue = default_queue
    if not isinstance(queue, str) or not queue:
        raise fail("queue", f"must be a non-empty string, got {queue!r}")

    rows: list[dict] | None = None
    dataset: str | None = None
    plain = False  # rows decoded from JSON are plain data already
    if "dataset" in raw:
        ds = raw["dataset"]
        if "dataset" in params:
            raise fail("env_params", "has a 'dataset' key, which each dataset row would overwrite")
        if isinstance(ds, list):
            dataset = "<inline>"
            try:
                rows = _rows_from_list(ds, "an inline dataset")
            except _DatasetError as exc:
                raise fail("dataset", str(exc), row=exc.row) from None
            rows = [_copy_tree(r) for r in rows]  # YAML aliases (*row) must not share objects
        elif isinstance(ds, str) and ds.strip():
            dataset = os.path.normpath(os.path.join(base_dir, os.path.expanduser(ds)))
            if roots is not None:
                try:
                    dataset = roots.resolve(dataset, "the file")
                except OutsideRoots as exc:
                    raise fail("dataset", str(exc)) from None
            ext = os.path.splitext(dataset)[1].lower()
            reader = _READERS.get(ext)
            if reader is None:
                raise fail("dataset", f"{ds!r}: unknown format {ext or '(no extension)'!r}; "
                                      f"expected one of {', '.join(DATASET_FORMATS)}")
            if not os.path.isfile(dataset):
                raise fail("dataset", f"{ds!r}: file not found (resolved to {dataset})")
            plain = reader in (_read_json, _read_jsonl)
            try:
                rows = reader(dataset)
            except _DatasetError as exc:
                raise fail("dataset", f"{ds!r}: {exc}", row=exc.row) from None
            except (OSError, UnicodeDecodeError) as exc:
                raise fail("dataset", f"{ds!r}: cannot read: {exc}") from None
        else:
            raise fail("dataset", f"must be a file path or a list of rows, got {ds!r}")
        if not rows:
            raise fail("dataset", f"{ds if isinstance(ds, str) else '<inline>'!r}: has no rows")
        for r, row in enumerate(() if plain else rows, 1):
            bad = _check_plain(row, "dataset")
            if bad:
                raise fail("dataset", bad, row=r)

    return {"index": e, "line": line, "env_name": name, "env_params": params, "env_num": env_num,
            "base_url": base_url, "seed": seed, "queue": queue, "rows": rows, "dataset": dataset,
            "transport": transport, "env_class": env_class}


# --------------------------------------------------------------------------- planning

def plan_job(paths: list[str], *, job_id: str, default_base_url: str = "",
             default_queue: str = "episodes", roots: ReadRoots | None = None) -> PlannedJob:
    """Validate every task file, then expand them into episode specs (no Redis).

    IDs: group ``{job_id}.{f}.{e}.{r}``, episode ``{group_id}.{k}`` (all 1-based: file in
    ``paths``, entry, dataset row, repeat). Seeds derive from (entry seed or 0, file basename,
    e, r, k) unless the entry says ``seed: null``. ``roots``: see :func:`load_task_file`.
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
        episodes, groups, by_env = _expand(paths, loaded, job_id)
    finally:
        if gc_was_enabled:
            gc.enable()

    return PlannedJob(episodes=episodes, groups=groups, sources=[os.path.abspath(p) for p in paths],
                      by_env=by_env, tokens=said.pop() if said else None, limits=limits,
                      pause_after_failures=pauses.pop() if pauses else None)


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
            transport, env_class = ent["transport"], ent["env_class"]
            # Each episode gets its own params: a shallow copy when nothing nested, else a
            # msgpack round-trip (a fast deep copy of JSON data; tuples come back as lists, as
            # they would from the ledger). No pickle anywhere.
            blob = None if _is_flat(params) else msgpack.packb(params, use_bin_type=True)
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
                    if prefix is None:
                        seed = None
                    else:
                        h = prefix.copy()
                        h.update(b"%d" % k)
                        seed = from_bytes(h.digest(), "big") % _SEED_MOD
                    # positional (checked against the schema at import): ~2x faster than kwargs
                    append(Spec(job_id, f"{group_id}.{k}", group_id, n, name, base_url, p,
                                seed, queue, source, transport, env_class))
            groups += len(tasks)
            by_env[name] = by_env.get(name, 0) + n * len(tasks)
    return episodes, groups, by_env
