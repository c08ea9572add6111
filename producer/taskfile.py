"""Task files (docs/protocol.md#task-files): read and validate them, entry by entry.

A task file is YAML::

    environments:
      - env_name: sokoban            # letters, digits, "_", "-", "."
        env_params: {level: 3}       # mapping, default {}
        dataset: data/puzzles.jsonl  # optional: path (.json/.jsonl/.yaml/.yml/.parquet) or inline list
        env_num: 4                   # episodes per task (the GRPO group size), default 1
        base_url: http://env:8000    # optional; else the producer's default
        seed: 7                      # optional; int base for derived seeds, or null = env chooses
        queue: episodes              # optional; else the producer's default
        env_image: registry/env:1.3  # optional; stored as job_environments.image, as the original does
        dataset_load_mode: eager     # optional; or parquet_row_ref: .parquet rows sent as references
        max_tokens: 256              # optional sampling of this entry's model calls, over the job's
        temperature: 0.0             #   flags (--llm-max-tokens, --temperature, --llm-stop); stored
        stop: ["</answer>"]          #   with each episode (EpisodeSpec.sampling)
        n: 4                         # optional: samples per task, the same as env_num (verl's rollout.n)

The keys are the original system's (``env_name``, ``env_params``, ``dataset``, ``env_num``,
``env_image``, ``dataset_load_mode``) and ours. Its task files carry others that its reader
ignores (``image``, ``demo_dataset``): they are ignored here too, with a warning naming them
(``meta["warnings"]``); a key one typo away from one we read is an error instead (``env_nums``
would quietly run one episode per task). An empty ``dataset`` (``""`` or null) is no dataset,
as there.

An entry may instead name an environment class that the worker runs in its own process::

      - env_name: textarena.GuessTheNumber-v0
        transport: inproc                                      # "http" (default) or "inproc"
        env_class: envs.textarena_env:TextArenaEnv  # "module:Class"; implies inproc

Such an entry needs no base_url (one given explicitly is an error). Only the shape
``module:Class`` is checked here: workers share no files with the producer, so whether the
class imports is for the worker to find out (``env_bad_request`` if it does not).

An entry may instead name an agent that owns its loop (``agent`` or ``agent_command``: an agent
episode), or hand its env server the model gateway (``env_calls_model: true``: an env-driven
episode): producer/agent_entries.py.

The datasets are read by ``producer/datasets.py``; the validated entries are expanded into
episode specs by ``producer/planning.py`` (``plan_job``). Nothing here touches Redis.

Everything is validated before anything is returned. Errors are :class:`TaskFileError`, whose
message names the file, the entry (1-based), the row (1-based) and the field at fault.
"""

from __future__ import annotations

import difflib
import os
import re
from typing import Any, Callable

import yaml

from broker.caps import check_limits
from broker.settings import redact_url
from broker.states import EnvProtocol
from broker.tokens import TOKEN_MODES, TOKENS_AUTO
from broker.urls import url_problem
from envs.base import valid_object_path
from producer.agent_entries import AGENT_TRANSPORT, entry_agent, entry_env_calls_model
from producer.datasets import (
    CHECKED_READERS,
    DATASET_FORMATS,
    READERS,
    DatasetError,
    parquet_row_refs,
    rows_from_list,
)
from producer.plaindata import check_plain, copy_tree, is_int
from producer.readroots import OutsideRoots, ReadRoots
from producer.yamlfile import load_yaml, yaml_error

__all__ = ["TaskFileError", "load_task_file", "DATASET_FORMATS"]

ENTRY_KEYS = ("env_name", "env_params", "dataset", "env_num", "base_url", "seed", "queue", "transport",
              "env_class", "env_image", "dataset_load_mode") + ("max_tokens", "temperature", "stop", "n") + (
              "agent", "agent_command", "env_calls_model") + (
              "protocol", "observation_to_messages", "completion_to_action", "split")
TRANSPORTS = ("http", "inproc")
# What an entry's env server speaks (broker/states.py EnvProtocol; absent: the original protocol),
# and what may go with each: OpenEnv's text mappings, ORS's task list of a split.
PROTOCOLS = tuple(p.value for p in EnvProtocol if p.value)
MAPPING_KEYS = ("observation_to_messages", "completion_to_action")
SPLIT_TASKS_MAX_BYTES = 64 * 2**20  # an ORS server's answer to /tasks, read at submit
SPLIT_TASKS_TIMEOUT_S = 30.0
# How a dataset file's rows go to the env, as the original system's reader takes them: read here
# and sent whole (eager), or, for a .parquet file, each row as a reference to its place in the
# file (PARQUET_ROW_REF, producer/datasets.py parquet_row_refs) for the env to read itself.
EAGER, PARQUET_ROW_REF = "eager", "parquet_row_ref"
DATASET_LOAD_MODES = (EAGER, PARQUET_ROW_REF)
# A key this close to one we read (difflib's ratio) is taken for a typo of it, not for a key of
# the original's files that its reader ignores ("image" and "env_image" are 0.71 apart).
TYPO_RATIO = 0.8
# "tokens" (optional): ask the model server for token ids and logprobs (broker/tokens.py
# TOKEN_MODES; true = "auto"); the job's setting, unless the command line set one.
# "limits" (optional): fleet-wide caps (broker/caps.py check_limits), their names checked
# against the entries; "pause_after_failures" (optional): the job pauses after that many
# episodes in a row failed alike (broker/pause.py; 0 = never); "resume" (optional, true by
# default): a new attempt may continue its predecessor's env instance (broker/resume.py); false
# for env servers whose instances must not outlive the worker that made them. "cache"
# (optional): the job's response cache (broker/cache.py): true, false or "sampled", as --cache.
TOP_KEYS = ("environments", "tokens", "limits", "pause_after_failures", "resume", "cache")

_ENV_NAME_RE = re.compile(r"[A-Za-z0-9_.\-]+")
_ABSENT = object()


class TaskFileError(ValueError):
    """A task file or dataset that cannot be used; the message says where and why."""


# Makes the error of one entry's field: (field, message, row or None) -> TaskFileError.
Fail = Callable[..., TaskFileError]


# --------------------------------------------------------------------------- task files

def load_task_file(path, *, default_base_url: str = "", default_queue: str = "episodes",
                   meta: dict | None = None, roots: ReadRoots | None = None) -> list[dict]:
    """Parse and validate one task file. Returns one normalized dict per entry::

        {"index": e, "line": yaml_line, "env_name": str, "env_params": dict, "env_num": int,
         "base_url": str ("" for inproc), "seed": int | None (None = explicit null), "queue": str,
         "rows": list[dict] | None (None = no dataset), "dataset": abs path | "<inline>" | None,
         "transport": "http" | "inproc", "env_class": "module:Class" | ""}

    ``"image"`` (the entry's ``env_image``, "" for none) joins them.

    Raises :class:`TaskFileError` naming file, entry, row and field. With ``roots`` (a path a
    request named), the file and its datasets are read only inside them, by their resolved paths.
    ``meta``, if given, receives the file's job-wide keys (``tokens``, ``limits``,
    ``pause_after_failures``, ``resume``) that it says, and ``warnings``: what was ignored, one
    line each.
    """
    path, doc, root = _read_task_file(path, roots)
    notes = Notes(path)
    envs = _entries_of(path, doc, notes)
    lines = _entry_lines(root)
    _job_settings(path, doc, meta)
    base_dir = os.path.dirname(os.path.abspath(path))
    entries = [_load_entry(path, base_dir, e, raw, lines[e - 1] if e - 1 < len(lines) else None,
                           default_base_url, default_queue, roots, notes)
               for e, raw in enumerate(envs, 1)]
    if meta is not None:
        meta["warnings"] = notes.lines()
    return entries


class Notes:
    """What a file's check let pass with a warning: keys it ignored, options without effect.
    One line per thing said, naming every entry it was said of."""

    def __init__(self, path: str):
        self.path = path
        self._said: dict[str, list[int]] = {}  # what -> entries (0: the top level)

    def add(self, what: str, entry: int = 0) -> None:
        self._said.setdefault(what, []).append(entry)

    def lines(self) -> list[str]:
        out = []
        for what, entries in self._said.items():
            at = [e for e in entries if e]
            where = (f"entry {at[0]}" if len(at) == 1 else f"entries {', '.join(map(str, at))}") if at else "top level"
            out.append(f"{self.path}: {where}: {what}")
        return out


def _other_keys(keys, allowed: tuple[str, ...], notes: Notes, entry: int, raise_typo: Callable[[str], None]) -> None:
    """Keys outside ``allowed``: a near-miss of one is an error (``raise_typo``), any other is
    ignored with a note, as the original system's reader ignores the keys it does not read."""
    for key in keys:
        if key in allowed:
            continue
        close = difflib.get_close_matches(key, allowed, n=1, cutoff=TYPO_RATIO) if isinstance(key, str) else []
        if close:
            raise_typo(f"unknown key {key!r}: did you mean {close[0]!r}? (allowed: {', '.join(allowed)})")
        notes.add(f"key {key!r} ignored: neither interactor nor the original system's reader reads it", entry)


def _read_task_file(path, roots: ReadRoots | None) -> tuple[str, Any, yaml.Node | None]:
    """The task file's path (resolved inside ``roots`` if given), its data and its root node."""
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
        doc, root = load_yaml(path)
    except yaml.YAMLError as exc:
        raise TaskFileError(f"{path}: not valid YAML: {yaml_error(exc)}") from None
    except OSError as exc:
        raise TaskFileError(f"{path}: cannot read: {exc}") from None
    return path, doc, root


def _entries_of(path: str, doc: Any, notes: Notes) -> list:
    """The file's ``environments`` list, once its top level is a mapping without typos of our keys."""
    if not isinstance(doc, dict):
        got = "an empty file" if doc is None else f"a {type(doc).__name__}"
        raise TaskFileError(f"{path}: top level must be a mapping with key 'environments', got {got}")

    def typo(msg: str) -> None:
        raise TaskFileError(f"{path}: top level: {msg}")

    _other_keys(doc, TOP_KEYS, notes, 0, typo)
    envs = doc.get("environments")
    if envs is None:
        raise TaskFileError(f"{path}: missing key 'environments' (a non-empty list of entries)")
    if not isinstance(envs, list) or not envs:
        raise TaskFileError(f"{path}: 'environments' must be a non-empty list of entries")
    return envs


def _entry_lines(root: yaml.Node | None) -> list[int | None]:
    """The line of each entry of ``environments`` (empty if the nodes do not say)."""
    lines: list[int | None] = []
    if isinstance(root, yaml.MappingNode):
        for k_node, v_node in root.value:
            if getattr(k_node, "value", None) == "environments" and isinstance(v_node, yaml.SequenceNode):
                lines = [n.start_mark.line + 1 for n in v_node.value]
    return lines


def _job_settings(path: str, doc: dict, meta: dict | None) -> None:
    """Check the file's job-wide keys and put those it says into ``meta`` (if given)."""
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
        if not is_int(n) or n < 0:
            raise TaskFileError(f"{path}: 'pause_after_failures' must be an integer >= 0 (0 = never pause), got {n!r}")
        if meta is not None:
            meta["pause_after_failures"] = n
    if "resume" in doc:
        if not isinstance(doc["resume"], bool):
            raise TaskFileError(f"{path}: 'resume' must be true or false, got {doc['resume']!r}")
        if meta is not None:
            meta["resume"] = doc["resume"]
    if "cache" in doc:
        cache = doc["cache"]
        if not (isinstance(cache, bool) or cache == "sampled"):
            raise TaskFileError(f"{path}: 'cache' must be true, false or \"sampled\", got {cache!r}")
        if meta is not None:
            meta["cache"] = "on" if cache is True else "" if cache is False else cache


# --------------------------------------------------------------------------- entries

def _entry_fail(at: str) -> Fail:
    """The error maker of one entry's fields; ``at`` names the file and the entry."""
    def fail(fld: str, msg: str, row: int | None = None) -> TaskFileError:
        where = at + (f" row {row}" if row is not None else "")
        return TaskFileError(f"{where}: field {fld!r}: {msg}")
    return fail


def _load_entry(path: str, base_dir: str, e: int, raw: Any, line: int | None,
                default_base_url: str, default_queue: str, roots: ReadRoots | None = None,
                notes: Notes | None = None) -> dict:
    """One entry of ``environments``, validated and normalized (see :func:`load_task_file`)."""
    at_line = f" (line {line})" if line else ""
    at = f"{path}: entry {e}{at_line}"
    fail = _entry_fail(at)
    notes = notes if notes is not None else Notes(path)

    if not isinstance(raw, dict):
        raise TaskFileError(f"{at}: an entry must be a mapping, got {type(raw).__name__}")

    def typo(msg: str) -> None:
        raise TaskFileError(f"{at}: {msg}")

    _other_keys(raw, ENTRY_KEYS, notes, e, typo)

    name = raw.get("env_name")
    if name is None:
        raise fail("env_name", "missing (a non-empty string)")
    if not isinstance(name, str) or not _ENV_NAME_RE.fullmatch(name):
        raise fail("env_name", f"must be a non-empty string of letters, digits, '_', '-', '.'; got {name!r}")
    # From here on the errors name the entry's env_name too.
    fail = _entry_fail(f"{path}: entry {e} ({name}" + (f", line {line})" if line else ")"))

    params = raw.get("env_params", {})
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise fail("env_params", f"must be a mapping, got {type(params).__name__}")
    bad = check_plain(params, "env_params")
    if bad:
        raise fail("env_params", bad)

    env_num = raw.get("env_num", 1)
    if not is_int(env_num) or env_num < 1:
        raise fail("env_num", f"must be an integer >= 1, got {env_num!r}")
    env_num = _samples(raw, env_num, fail)
    sampling = _sampling(raw, fail)

    env_calls_model = entry_env_calls_model(raw, fail)  # first: it names what it cannot go with
    agent, agent_command = entry_agent(raw, fail)
    if agent or agent_command:
        transport, env_class, base_url = AGENT_TRANSPORT, "", ""
    else:
        transport, env_class, base_url = _entry_target(raw, default_base_url, fail)

    seed = raw.get("seed", _ABSENT)
    if seed is _ABSENT:
        seed = 0
    elif seed is not None and not is_int(seed):
        raise fail("seed", f"must be an integer or null, got {seed!r}")

    queue = raw.get("queue", _ABSENT)
    if queue is _ABSENT:
        queue = default_queue
    if not isinstance(queue, str) or not queue:
        raise fail("queue", f"must be a non-empty string, got {queue!r}")

    image = raw.get("env_image")
    if image is None:
        image = ""  # as the original stores an entry without one
    if not isinstance(image, str):
        raise fail("env_image", f"must be a string (the environment's image, e.g. 'registry/env:1.3'), got {image!r}")

    protocol, mapping, split = _entry_protocol(raw, transport, fail)
    mode = _load_mode(raw, fail)
    ds = raw.get("dataset")
    if split:
        rows, dataset = _split_rows(base_url, name, split, params, fail), f"<split {split}>"
    elif ds is None or (isinstance(ds, str) and not ds.strip()):
        # "" or null: no dataset, as the original reads it (its files say `dataset: ""`)
        rows, dataset = None, None
        if "dataset_load_mode" in raw and raw["dataset_load_mode"] not in (None, ""):
            notes.add("dataset_load_mode without a dataset has no effect", e)
    else:
        rows, dataset = _entry_rows(raw, params, base_dir, roots, fail, mode, notes, e)

    return {"index": e, "line": line, "env_name": name, "env_params": params, "env_num": env_num,
            "base_url": base_url, "seed": seed, "queue": queue, "rows": rows, "dataset": dataset,
            "transport": transport, "env_class": env_class, "image": image, "sampling": sampling,
            "agent": agent, "agent_command": agent_command, "env_calls_model": env_calls_model,
            "protocol": protocol, "mapping": mapping}


def _entry_protocol(raw: dict, transport: str, fail: Fail) -> tuple[str, dict[str, str], str]:
    """The entry's ``protocol`` ("" the original's), its ``observation_to_messages`` /
    ``completion_to_action`` (OpenEnv) and its ``split`` (ORS): docs/environments.md."""
    protocol = raw.get("protocol")
    if protocol is None or protocol == "":
        protocol = ""
    elif protocol not in PROTOCOLS:
        raise fail("protocol", f"must be one of {', '.join(PROTOCOLS)} (absent: the original protocol), got {protocol!r}")
    elif transport != "http":
        raise fail("protocol", "is what an env server speaks: only for an entry with a base_url")
    mapping = {}
    for key in MAPPING_KEYS:
        path = raw.get(key)
        if path is None:
            continue
        if protocol != EnvProtocol.OPENENV:
            raise fail(key, "only with protocol: openenv (it maps an OpenEnv observation or action)")
        if not valid_object_path(path):
            raise fail(key, f"must be 'module:function' (e.g. 'mypkg.mappings:{key}'), got {path!r}")
        mapping[key] = path
    split = raw.get("split")
    if split is not None:
        if protocol != EnvProtocol.ORS:
            raise fail("split", "only with protocol: ors (its server lists a split's tasks)")
        if not isinstance(split, str) or not split:
            raise fail("split", f"must be the name of one of the server's splits, got {split!r}")
        if raw.get("dataset") not in (None, ""):
            raise fail("split", "an entry's tasks come from its dataset or from a split of its server, not both")
    return protocol, mapping, split or ""


def _split_rows(base_url: str, env_name: str, split: str, params: dict, fail: Fail) -> list[dict]:
    """The tasks of an ORS server's ``split`` (``POST {base_url}/{env_name}/tasks``), one row each."""
    import urllib.error
    import urllib.request

    import orjson

    if "dataset" in params:
        raise fail("env_params", "has a 'dataset' key, which each task of the split would overwrite")
    url = f"{base_url.rstrip('/')}/{env_name}/tasks"
    shown = redact_url(url)
    request = urllib.request.Request(url, data=orjson.dumps({"split": split}), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.build_opener(urllib.request.HTTPRedirectHandler()).open(
                request, timeout=SPLIT_TASKS_TIMEOUT_S) as resp:
            body = resp.read(SPLIT_TASKS_MAX_BYTES + 1)
    except urllib.error.HTTPError as exc:
        detail = exc.read(500).decode("utf-8", "replace").strip()
        raise fail("split", f"{split!r}: POST {shown} answered HTTP {exc.code}: {detail or exc.reason}") from None
    except (OSError, ValueError) as exc:
        raise fail("split", f"{split!r}: POST {shown} failed: {exc} (is the ORS server up? --no-preflight does not "
                            "skip this: the tasks are the job)") from None
    if len(body) > SPLIT_TASKS_MAX_BYTES:
        raise fail("split", f"{split!r}: POST {shown} answered more than {SPLIT_TASKS_MAX_BYTES} bytes")
    try:
        tasks = orjson.loads(body).get("tasks")
    except (orjson.JSONDecodeError, AttributeError):
        tasks = None
    if not isinstance(tasks, list):
        raise fail("split", f"{split!r}: POST {shown} answered no 'tasks' list")
    if not tasks:
        raise fail("split", f"{split!r}: the server lists no tasks for it")
    for r, task in enumerate(tasks, 1):
        if not isinstance(task, dict):
            raise fail("split", f"{split!r}: task {r} is a {type(task).__name__}, not an object", row=r)
        bad = check_plain(task, "split")
        if bad:
            raise fail("split", bad, row=r)
    return tasks


def _samples(raw: dict, env_num: int, fail: Fail) -> int:
    """The entry's episodes per task: ``env_num``, or ``n`` (verl's and TRL's name for it)."""
    if "n" not in raw:
        return env_num
    n = raw["n"]
    if not is_int(n) or n < 1:
        raise fail("n", f"must be an integer >= 1 (samples per task, the same as env_num), got {n!r}")
    if "env_num" in raw and raw["env_num"] != n:
        raise fail("n", f"is {n} and env_num is {raw['env_num']}: both count the samples per task; give one")
    return n


def _sampling(raw: dict, fail: Fail) -> dict:
    """The entry's own ``max_tokens``, ``temperature`` and ``stop`` (a string or a list of
    strings, kept as a list), checked; the worker lays them over the job's settings."""
    out: dict = {}
    if raw.get("max_tokens") is not None:
        v = raw["max_tokens"]
        if not is_int(v) or v < 1:
            raise fail("max_tokens", f"must be an integer >= 1 (tokens per model answer), got {v!r}")
        out["max_tokens"] = v
    if raw.get("temperature") is not None:
        v = raw["temperature"]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 100:
            raise fail("temperature", f"must be a number >= 0, got {v!r}")
        out["temperature"] = float(v)
    if raw.get("stop") is not None:
        v = raw["stop"]
        stops = [v] if isinstance(v, str) else v
        if not isinstance(stops, list) or not stops or not all(isinstance(x, str) and x for x in stops):
            raise fail("stop", f"must be a non-empty string or a list of them, got {v!r}")
        out["stop"] = list(stops)
    return out


def _load_mode(raw: dict, fail: Fail) -> str:
    """The entry's ``dataset_load_mode``: eager when it says none (absent, null or blank)."""
    mode = raw.get("dataset_load_mode")
    if mode is None:
        return EAGER
    if not isinstance(mode, str) or mode.strip() not in DATASET_LOAD_MODES + ("",):
        raise fail("dataset_load_mode", f"must be {EAGER!r} (the rows are read here and sent) or "
                                        f"{PARQUET_ROW_REF!r} (each row of a .parquet dataset sent as a reference "
                                        f"to its place in the file, for the env to read), got {mode!r}")
    return mode.strip() or EAGER


def _entry_target(raw: dict, default_base_url: str, fail: Fail) -> tuple[str, str, str]:
    """Where the entry's episodes run: (transport, env_class or "", base_url or "")."""
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
        return transport, env_class, ""
    if env_class is not _ABSENT:
        raise fail("env_class", "only used with transport inproc (remove it, or say transport: inproc)")
    base_url = raw.get("base_url", _ABSENT)
    if base_url is _ABSENT or base_url is None:
        if not default_base_url:
            raise fail("base_url", "missing, and no default env base URL was given: name the entry's env server "
                                   "(base_url: http://HOST:PORT), or one for every entry with --env-base-url URL; "
                                   "the bundled envs and the reasoning-gym and textarena adapters are served by "
                                   "`interactor serve-env --port 8080` (then --env-base-url http://127.0.0.1:8080)")
        base_url, from_default = default_base_url, True
    else:
        from_default = False
    # The check workers repeat before any call (broker/urls.py): refused here, at submit.
    problem = url_problem(base_url)
    if problem:
        src = " (the default)" if from_default else ""
        shown = redact_url(base_url) if isinstance(base_url, str) else base_url
        raise fail("base_url", f"not an accepted http(s) URL{src}: {problem}; got {shown!r}")
    return transport, "", base_url


def _entry_rows(raw: dict, params: dict, base_dir: str, roots: ReadRoots | None, fail: Fail,
                mode: str = EAGER, notes: Notes | None = None, e: int = 0) -> tuple[list[dict], str]:
    """The rows of the entry's ``dataset`` (inline, or a file beside the task file) and what it
    was: its absolute path or ``"<inline>"``. With ``mode`` parquet_row_ref, a .parquet file's
    rows are references to them (the original's other formats are read whole whatever the mode:
    said in ``notes``)."""
    ds = raw["dataset"]
    if "dataset" in params:
        raise fail("env_params", "has a 'dataset' key, which each dataset row would overwrite")
    plain = False  # rows decoded from JSON are plain data already
    if mode == PARQUET_ROW_REF and not (isinstance(ds, str) and ds.strip().lower().endswith(".parquet")):
        if notes is not None:
            notes.add(f"dataset_load_mode {PARQUET_ROW_REF!r} applies to .parquet files only: "
                      "these rows are read and sent whole, as the original system reads them", e)
        mode = EAGER
    if isinstance(ds, list):
        dataset = "<inline>"
        try:
            rows = rows_from_list(ds, "an inline dataset")
        except DatasetError as exc:
            raise fail("dataset", str(exc), row=exc.row) from None
        rows = [copy_tree(r) for r in rows]  # YAML aliases (*row) must not share objects
    elif isinstance(ds, str) and ds.strip():
        dataset = os.path.normpath(os.path.join(base_dir, os.path.expanduser(ds)))
        if roots is not None:
            try:
                dataset = roots.resolve(dataset, "the file")
            except OutsideRoots as exc:
                raise fail("dataset", str(exc)) from None
        ext = os.path.splitext(dataset)[1].lower()
        reader = READERS.get(ext)
        if reader is None:
            raise fail("dataset", f"{ds!r}: unknown format {ext or '(no extension)'!r}; "
                                  f"expected one of {', '.join(DATASET_FORMATS)}")
        if not os.path.isfile(dataset):
            raise fail("dataset", f"{ds!r}: file not found (resolved to {dataset})")
        if mode == PARQUET_ROW_REF:
            reader = parquet_row_refs
        plain = reader in CHECKED_READERS or reader is parquet_row_refs
        try:
            rows = reader(dataset)
        except DatasetError as exc:
            raise fail("dataset", f"{ds!r}: {exc}", row=exc.row) from None
        except (OSError, UnicodeDecodeError) as exc:
            raise fail("dataset", f"{ds!r}: cannot read: {exc}") from None
    else:
        raise fail("dataset", f"must be a file path or a list of rows, got {ds!r}")
    if not rows:
        raise fail("dataset", f"{ds if isinstance(ds, str) else '<inline>'!r}: has no rows")
    for r, row in enumerate(() if plain else rows, 1):
        bad = check_plain(row, "dataset")
        if bad:
            raise fail("dataset", bad, row=r)
    return rows, dataset
