"""What a job may make a worker import, and where it may make it connect.

A job is data written by whoever can submit one (or write one Redis key). Workers hold the
fleet's API key and run in the fleet's network, so the job gets no say in which code they
import or which hosts they call beyond what the worker's own settings allow (review M3, L9):

* ``env_classes`` / ``episode_hooks``: ``module:Attr`` paths a worker may import, as patterns:
  ``module:Attr`` exactly, ``module:*`` (anything in that module) or ``package.*`` (anything in
  a module under that package). Nothing outside is imported at all, so an ``os:abort`` in a
  task file is a dead letter (``bad_task``), not a dead worker.
* ``env_hosts``: env servers a worker may call (``host``, ``host:port`` or
  ``scheme://host:port``); empty means any.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from envs.base import split_object_path

# The bundled env adapters (inproc transport) and the built-in hooks.
DEFAULT_ENV_CLASSES = ("envs.*",)
DEFAULT_EPISODE_HOOKS = ("workers.experience:*",)


class PathAllowlist:
    """``module:Attr`` patterns (see the module docstring)."""

    def __init__(self, patterns: str | tuple[str, ...] | list[str], *, also: tuple[str, ...] = ()):
        items = patterns.split(",") if isinstance(patterns, str) else list(patterns)
        self.patterns = tuple(p.strip() for p in [*items, *also] if p and p.strip())

    def allows(self, path: str) -> bool:
        parts = split_object_path(path)
        if parts is None:
            return False
        module, _ = parts
        for p in self.patterns:
            if p == path:
                return True
            if p.endswith(":*") and p[:-2] == module:
                return True
            if p.endswith(".*") and ":" not in p and (module + ".").startswith(p[:-1]):
                return True
        return False

    def __str__(self) -> str:
        return ", ".join(self.patterns) or "(nothing)"


class HostAllowlist:
    """Env servers a worker may call; empty = any."""

    def __init__(self, hosts: str):
        self.entries = tuple(h.strip().lower() for h in hosts.split(",") if h.strip())

    def allows(self, url: str) -> bool:
        if not self.entries:
            return True
        try:
            parts = urlsplit(url)
            host = (parts.hostname or "").lower()
            port = parts.port or {"http": 80, "https": 443}.get(parts.scheme.lower(), 0)
        except ValueError:
            return False
        candidates = {host, f"{host}:{port}", f"{parts.scheme.lower()}://{host}:{port}"}
        return any(e in candidates for e in self.entries)

    def __str__(self) -> str:
        return ", ".join(self.entries) or "(any)"


def env_class_allowlist(setting: str) -> PathAllowlist:
    return PathAllowlist(setting or DEFAULT_ENV_CLASSES)


def hook_allowlist(setting: str, own_hook: str = "") -> PathAllowlist:
    """The worker's own ``episode_hook`` setting is always allowed: it chose it itself."""
    return PathAllowlist(setting or DEFAULT_EPISODE_HOOKS, also=(own_hook,) if own_hook else ())
