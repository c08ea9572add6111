"""Episode hooks: code the user plugs into the step loop (the original's EpisodeHandler).

A hook is loaded in the worker from a dotted path ``module:factory``; the factory is called
with no arguments and returns an object with ``handle`` and ``on_episode_end``. Both may be
missing (a no-op is used). Hook errors are logged and never end the episode.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

from broker.errors import BAD_TASK, EpisodeError
from envs.base import import_object, valid_object_path


class EpisodeHook(Protocol):
    def handle(self, env_name: str, env_id: str, step_id: int, prompt: Any) -> Any: ...
    def on_episode_end(self, env_name: str, env_id: str, total_reward: float, info: dict | None) -> None: ...


class NullHook:
    def handle(self, env_name: str, env_id: str, step_id: int, prompt: Any) -> Any:
        return prompt

    def on_episode_end(self, env_name: str, env_id: str, total_reward: float, info: dict | None) -> None:
        return None


class HookError(EpisodeError, ValueError):
    """A hook that cannot be loaded: the job named it, so its episodes are ``bad_task``."""

    def __init__(self, message: str):
        super().__init__(BAD_TASK, message, transient=False)


class _Adapter:
    """Fills in whichever of the two methods a user's hook does not define."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.handle = getattr(inner, "handle", NullHook.handle.__get__(self))
        self.on_episode_end = getattr(inner, "on_episode_end", NullHook.on_episode_end.__get__(self))


_cache: dict[str, EpisodeHook] = {}
_lock = threading.Lock()


def load_hook(path: str) -> EpisodeHook:
    """One hook instance per dotted path per process (hooks may hold state, e.g. an index)."""
    if not path:
        return NullHook()
    with _lock:
        if path not in _cache:
            if not valid_object_path(path):
                raise HookError(f"episode hook {path!r}: expected 'module:factory'")
            try:
                factory = import_object(path)
            except (ImportError, AttributeError) as exc:
                raise HookError(f"episode hook {path!r}: cannot import: {exc}") from None
            _cache[path] = _Adapter(factory())
        return _cache[path]
