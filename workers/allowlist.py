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
* ``agents`` / ``agent_commands``: the agents of agent episodes (workers/agent_episode.py) a
  worker may import (``module:function`` patterns, as env classes) or run (argv prefixes: an
  agent command must start with one, word for word); unset, none.
* the API key goes only to a model endpoint of a trusted origin (``llm_base_url``'s and
  ``llm_trusted_origins``): a job may name any endpoint, and one that would collect the key
  gets requests without it.

:class:`TrustBoundary` applies all of it to one delivery, before anything is imported or called.
"""

from __future__ import annotations

import logging

from broker.records import EpisodeSpec, JobSpec
from broker.settings import Settings, redact_url
from broker.urls import UrlError, check_url, origin_of, url_problem
from envs.base import split_object_path, valid_object_path

log = logging.getLogger("interactor.worker")

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


class CommandAllowlist:
    """Agent commands a worker may run: argv prefixes (comma-separated, words split by spaces)."""

    def __init__(self, setting: str):
        self.prefixes = tuple(tuple(p.split()) for p in setting.split(",") if p.split())

    def allows(self, argv: list[str]) -> bool:
        return any(len(argv) >= len(p) and tuple(argv[:len(p)]) == p for p in self.prefixes)

    def __str__(self) -> str:
        return ", ".join(" ".join(p) for p in self.prefixes) or "(nothing)"


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


class TrustBoundary:
    """A worker process's allow-lists, and the checks a delivery passes before it runs."""

    def __init__(self, settings: Settings):
        self.env_classes = env_class_allowlist(settings.env_classes)
        self.hooks = hook_allowlist(settings.episode_hooks, settings.episode_hook)
        self.env_hosts = HostAllowlist(settings.env_hosts)
        self.agents = PathAllowlist(settings.agents)
        self.agent_commands = CommandAllowlist(settings.agent_commands)
        self.key_origins = settings.trusted_model_origins()
        self._api_key = settings.llm_api_key
        self._untrusted_warned: set[str] = set()

    def refused(self, job: JobSpec, spec: EpisodeSpec) -> str:
        """Why this worker will not run the episode ("" = it will): code and hosts a job names
        must be on the worker's own allow-lists; nothing is imported before that check. URLs get
        the submit-time check again (broker/urls.py): the job may not have come from our producer."""
        problem = url_problem(job.llm_base_url)
        if problem:
            return f"model endpoint {redact_url(job.llm_base_url)!r}: {problem}; nothing was called"
        agent, command = getattr(spec, "agent", ""), getattr(spec, "agent_command", None)
        if agent or command:
            refused = self._agent_refused(agent, command)
            if refused:
                return refused
        elif spec.transport != "inproc":
            problem = url_problem(spec.base_url)
            if problem:
                return f"env server {redact_url(spec.base_url)!r}: {problem}; nothing was called"
        if job.episode_hook and not valid_object_path(job.episode_hook):
            return (f"episode hook {job.episode_hook!r} is not 'module:attribute' (one attribute, no dotted "
                    "path); it was not imported")
        if spec.transport == "inproc":
            if not valid_object_path(spec.env_class):
                return (f"env_class {spec.env_class!r} is not 'module:Class' (one attribute, no dotted path); "
                        "it was not imported")
            if not self.env_classes.allows(spec.env_class):
                return (f"env_class {spec.env_class!r} is not on this worker's allow-list "
                        f"(INTERACTOR_ENV_CLASSES: {self.env_classes}); it was not imported")
        elif not (agent or command) and not self.env_hosts.allows(spec.base_url):
            return (f"env server {redact_url(spec.base_url)} is not on this worker's allow-list "
                    f"(INTERACTOR_ENV_HOSTS: {self.env_hosts})")
        if job.episode_hook and not self.hooks.allows(job.episode_hook):
            return (f"episode hook {job.episode_hook!r} is not on this worker's allow-list "
                    f"(INTERACTOR_EPISODE_HOOKS: {self.hooks}); it was not imported")
        # an entry's observation_to_messages / completion_to_action (workers/env_mappings.py):
        # code a task file names, allowed as env classes are
        for key, path in sorted((getattr(spec, "mapping", None) or {}).items()):
            if not valid_object_path(path):
                return f"{key} {path!r} is not 'module:function' (one attribute, no dotted path); it was not imported"
            if not self.env_classes.allows(path):
                return (f"{key} {path!r} is not on this worker's allow-list (INTERACTOR_ENV_CLASSES: "
                        f"{self.env_classes}); it was not imported")
        return ""

    def _agent_refused(self, agent: str, command: list | None) -> str:
        if agent:
            if not valid_object_path(agent):
                return f"agent {agent!r} is not 'module:function' (one attribute, no dotted path); it was not imported"
            if not self.agents.allows(agent):
                return (f"agent {agent!r} is not on this worker's allow-list (INTERACTOR_AGENTS: {self.agents}); "
                        "it was not imported")
            return ""
        if not isinstance(command, list) or not command or not all(isinstance(a, str) and a for a in command):
            return f"agent_command {command!r} is not a non-empty list of strings; nothing was run"
        if not self.agent_commands.allows(command):
            return (f"agent_command {' '.join(command)[:200]!r} is not on this worker's allow-list "
                    f"(INTERACTOR_AGENT_COMMANDS: {self.agent_commands}); nothing was run")
        return ""

    def api_key_for(self, job: JobSpec) -> str:
        """The API key, only for a model endpoint this worker trusts with it (a job may name any
        endpoint; the key must not go to one that would collect it)."""
        key = self._api_key.reveal()
        if key and origin_of(job.llm_base_url) not in self.key_origins:
            if job.job_id not in self._untrusted_warned:
                self._untrusted_warned.add(job.job_id)
                log.warning("job %s: model endpoint %s is not a trusted origin (INTERACTOR_LLM_TRUSTED_ORIGINS); "
                            "its requests go without the API key", job.job_id, redact_url(job.llm_base_url))
            return ""
        return key
