"""What a job may make a worker import, and where it may make it connect.

A job is data written by whoever can submit one (or write one Redis key). Workers hold the
fleet's API key and run in the fleet's network, so the job gets no say in which code they
import or which hosts they call beyond what the worker's own settings allow:

* ``env_classes`` / ``episode_hooks``: ``module:Attr`` paths a worker may import, as patterns:
  ``module:Attr`` exactly, ``module:*`` (anything that module defines) or ``package.*``
  (anything a module under that package defines). A path is one attribute of one module (no
  dotted path after the colon), and what it names must be defined in that module
  (``envs.base.import_object`` checks ``__module__``): ``somemodule:*`` never reaches the
  ``os`` that module imported. Nothing off the list is imported at all, so an ``os:abort`` in a
  task file is a dead letter (``bad_task``), not a dead worker.
* ``env_hosts``: env servers a worker may call (``host``, ``host:port`` or
  ``scheme://host:port``); empty means any. Whatever the list, a URL must pass
  ``broker.urls.check_url``, and the comparison is made on the host and port it approved.
"""

from __future__ import annotations

from broker.urls import UrlError, check_url, origin_of
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
    """Env servers a worker may call; empty = any host (still only URLs ``check_url`` accepts)."""

    def __init__(self, hosts: str):
        entries = []
        for h in hosts.split(","):
            h = h.strip().lower()
            if h:
                # scheme://host:port entries are compared as the origin check_url makes of them.
                entries.append((origin_of(h) or h) if "://" in h else h)
        self.entries = tuple(entries)

    def allows(self, url: str) -> bool:
        try:
            target = check_url(url)
        except UrlError:
            return False
        if not self.entries:
            return True
        candidates = {target.host, f"{target.host}:{target.port}", target.origin}
        return any(e in candidates for e in self.entries)

    def __str__(self) -> str:
        return ", ".join(self.entries) or "(any)"


def env_class_allowlist(setting: str) -> PathAllowlist:
    return PathAllowlist(setting or DEFAULT_ENV_CLASSES)


def hook_allowlist(setting: str, own_hook: str = "") -> PathAllowlist:
    """The worker's own ``episode_hook`` setting is always allowed: it chose it itself."""
    return PathAllowlist(setting or DEFAULT_EPISODE_HOOKS, also=(own_hook,) if own_hook else ())
