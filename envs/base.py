"""The environment class contract shared by both transports, and small helpers for adapters.

An environment class (what ``env_class: module:Class`` names in a task file, and what
``interactor serve-env`` hosts behind docs/protocol.md#environment-server) looks like this::

    class MyEnv:
        def __init__(self, env_name: str = ""): ...          # env_name keyword is optional
        def reset(self, env_param: dict, seed: int | None) -> dict:   # {"observation", "info"}
        def get_task_prompt(self) -> list[dict]:             # chat messages; [] = episode over
        def step(self, action: str) -> dict:                 # reward, terminated, truncated, info
        def close(self) -> None:

One instance serves one episode. ``env_param`` is the task entry's ``env_params`` plus
``"dataset": <row>`` when the entry has a dataset, else ``"dataset": {}``. Answers may be dicts/lists, pydantic models
(``model_dump``) or JSON bytes. Raise :class:`EnvError` (any ``ValueError``) for a bad
request (unknown task, bad parameters, a step after the end): HTTP 400, or the permanent
``env_bad_request`` in the worker. Any other exception is a failure inside the environment:
HTTP 500, or the transient ``env_server_error`` (the episode is retried from a fresh reset).

Nothing here imports an optional library; adapters import theirs on first use.
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
import threading
from typing import Any

__all__ = ["EnvError", "params_with_row", "import_object", "split_object_path", "valid_object_path", "construct", "normalize_answer", "jsonable"]

_PATH_RE = re.compile(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*", re.ASCII)


class EnvError(ValueError):
    """A bad request: unknown task, bad parameters, or a call the instance cannot take."""


def valid_object_path(path: Any) -> bool:
    """True for ``package.module:Attr``: one attribute of the module, no dotted path after the
    colon (``module:os.abort`` would reach whatever the module imported). The one rule for every
    ``module:Attr`` a task file or a setting names: env classes, episode hooks, allow-lists."""
    return isinstance(path, str) and bool(_PATH_RE.fullmatch(path))


def split_object_path(path: str) -> tuple[str, str] | None:
    """``("package.module", "Attr")`` of a valid ``module:Attr`` path, else None."""
    if not valid_object_path(path):
        return None
    module, _, attr = path.partition(":")
    return module, attr


_imports: dict[str, Any] = {}
_imports_lock = threading.Lock()


def import_object(path: str) -> Any:
    """``module:Attr`` -> the object (cached). ImportError/AttributeError propagate.

    The object must be defined in the module named (its ``__module__``), not merely reachable
    from it: an allow-list that admits ``somemodule:*`` admits that module's own classes and
    functions, never ``os.abort`` or a class it imported from elsewhere."""
    with _imports_lock:
        obj = _imports.get(path)
        if obj is not None:
            return obj
    if not valid_object_path(path):
        raise ImportError(f"{path!r} is not of the form 'module:Attr' (one attribute, no dotted path)")
    module_name, _, attr = path.partition(":")
    obj = getattr(importlib.import_module(module_name), attr)
    defined_in = getattr(obj, "__module__", None)
    if inspect.ismodule(obj) or defined_in != module_name:
        raise ImportError(f"{path!r} is not defined in {module_name} (it comes from "
                          f"{getattr(obj, '__name__', None) if inspect.ismodule(obj) else defined_in}); "
                          "only what a module defines itself may be named")
    with _imports_lock:
        _imports[path] = obj
    return obj


_takes_env_name: dict[Any, bool] = {}


def construct(cls: Any, env_name: str) -> Any:
    """``cls(env_name=...)`` when its constructor takes that keyword (or ``**kwargs``), else ``cls()``."""
    takes = _takes_env_name.get(cls)
    if takes is None:
        try:
            sig = inspect.signature(cls)
            takes = "env_name" in sig.parameters or any(
                p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())
        except (TypeError, ValueError):
            takes = False
        _takes_env_name[cls] = takes
    return cls(env_name=env_name) if takes else cls()


def params_with_row(env_param: Any) -> dict:
    """The entry's params with the dataset row's keys on top (a row overrides the entry)."""
    if env_param is None:
        return {}
    if not isinstance(env_param, dict):
        raise EnvError(f"env_param must be an object, got {type(env_param).__name__}")
    out = {k: v for k, v in env_param.items() if k != "dataset"}
    row = env_param.get("dataset")
    if row is not None:
        if not isinstance(row, dict):
            raise EnvError("env_param 'dataset' must be an object (one dataset row)")
        out.update(row)
    return out


def int_param(params: dict, key: str, default: int | None, *, minimum: int | None = None) -> int | None:
    value = params.get(key, default)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, str) and re.fullmatch(r"-?\d+", value.strip()):
        value = int(value.strip())
    if isinstance(value, bool) or not isinstance(value, int):
        raise EnvError(f"env_param {key!r} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise EnvError(f"env_param {key!r} must be >= {minimum}, got {value}")
    return value


def normalize_answer(result: Any) -> Any:
    """What an environment method returned, as plain JSON-shaped data (the original driver's
    ``_normalize_inproc_result``): pydantic models, JSON bytes, dicts and lists."""
    if hasattr(result, "model_dump"):
        return result.model_dump(mode="json")
    if isinstance(result, memoryview):
        return json.loads(result.tobytes())
    if isinstance(result, (bytes, bytearray)):
        return json.loads(result)
    if isinstance(result, (list, dict)):
        return result
    raise TypeError(f"unsupported answer type {type(result).__name__} (expected a dict, a list, "
                    "JSON bytes or a pydantic model)")


def jsonable(value: Any) -> Any:
    """A JSON-safe copy (unknown objects become strings); for ``info`` fields built from
    library objects."""
    return json.loads(json.dumps(value, default=str))


