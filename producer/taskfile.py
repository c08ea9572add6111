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

An entry may instead name an environment class that the worker runs in its own process::

      - env_name: textarena.GuessTheNumber-v0
        transport: inproc                                      # "http" (default) or "inproc"
        env_class: envs.textarena_env:TextArenaEnv  # "module:Class"; implies inproc

Such an entry needs no base_url (one given explicitly is an error). Only the shape
``module:Class`` is checked here: workers share no files with the producer, so whether the
class imports is for the worker to find out (``env_bad_request`` if it does not).

The datasets are read by ``producer/datasets.py``; the validated entries are expanded into
episode specs by ``producer/planning.py`` (``plan_job``). Nothing here touches Redis.

Everything is validated before anything is returned. Errors are :class:`TaskFileError`, whose
message names the file, the entry (1-based), the row (1-based) and the field at fault.
"""

from __future__ import annotations

import os
import re
from typing import Any, Callable

import yaml

from broker.caps import check_limits
from broker.settings import redact_url
from broker.tokens import TOKEN_MODES, TOKENS_AUTO
from broker.urls import url_problem
from envs.base import valid_object_path
from producer.datasets import CHECKED_READERS, DATASET_FORMATS, READERS, DatasetError, rows_from_list
from producer.plaindata import check_plain, copy_tree, is_int
from producer.readroots import OutsideRoots, ReadRoots
from producer.yamlfile import load_yaml, yaml_error

__all__ = ["TaskFileError", "load_task_file", "DATASET_FORMATS"]

ENTRY_KEYS = ("env_name", "env_params", "dataset", "env_num", "base_url", "seed", "queue", "transport",
              "env_class")
TRANSPORTS = ("http", "inproc")
# "tokens" (optional): ask the model server for token ids and logprobs (broker/tokens.py
# TOKEN_MODES; true = "auto"); the job's setting, unless the command line set one.
# "limits" (optional): fleet-wide caps (broker/caps.py check_limits), their names checked
# against the entries; "pause_after_failures" (optional): the job pauses after that many
# episodes in a row failed alike (broker/pause.py; 0 = never); "resume" (optional, true by
# default): a new attempt may continue its predecessor's env instance (broker/resume.py); false
# for env servers whose instances must not outlive the worker that made them.
TOP_KEYS = ("environments", "tokens", "limits", "pause_after_failures", "resume")

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

    Raises :class:`TaskFileError` naming file, entry, row and field. With ``roots`` (a path a
    request named), the file and its datasets are read only inside them, by their resolved paths.
    ``meta``, if given, receives the file's job-wide keys (``tokens``, ``limits``,
    ``pause_after_failures``, ``resume``) that it says.
    """
    path, doc, root = _read_task_file(path, roots)
    envs = _entries_of(path, doc)
    lines = _entry_lines(root)
    _job_settings(path, doc, meta)
    base_dir = os.path.dirname(os.path.abspath(path))
    return [_load_entry(path, base_dir, e, raw, lines[e - 1] if e - 1 < len(lines) else None,
                        default_base_url, default_queue, roots)
            for e, raw in enumerate(envs, 1)]


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


def _entries_of(path: str, doc: Any) -> list:
    """The file's ``environments`` list, once its top level is a mapping of known keys."""
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


# --------------------------------------------------------------------------- entries

def _entry_fail(at: str) -> Fail:
    """The error maker of one entry's fields; ``at`` names the file and the entry."""
    def fail(fld: str, msg: str, row: int | None = None) -> TaskFileError:
        where = at + (f" row {row}" if row is not None else "")
        return TaskFileError(f"{where}: field {fld!r}: {msg}")
    return fail


def _load_entry(path: str, base_dir: str, e: int, raw: Any, line: int | None,
                default_base_url: str, default_queue: str, roots: ReadRoots | None = None) -> dict:
    """One entry of ``environments``, validated and normalized (see :func:`load_task_file`)."""
    at_line = f" (line {line})" if line else ""
    at = f"{path}: entry {e}{at_line}"
    fail = _entry_fail(at)

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

    rows, dataset = _entry_rows(raw, params, base_dir, roots, fail) if "dataset" in raw else (None, None)

    return {"index": e, "line": line, "env_name": name, "env_params": params, "env_num": env_num,
            "base_url": base_url, "seed": seed, "queue": queue, "rows": rows, "dataset": dataset,
            "transport": transport, "env_class": env_class}


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
    return transport, "", base_url


def _entry_rows(raw: dict, params: dict, base_dir: str, roots: ReadRoots | None,
                fail: Fail) -> tuple[list[dict], str]:
    """The rows of the entry's ``dataset`` (inline, or a file beside the task file) and what it
    was: its absolute path or ``"<inline>"``."""
    ds = raw["dataset"]
    if "dataset" in params:
        raise fail("env_params", "has a 'dataset' key, which each dataset row would overwrite")
    plain = False  # rows decoded from JSON are plain data already
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
        plain = reader in CHECKED_READERS
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
