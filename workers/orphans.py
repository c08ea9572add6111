"""Closing env instances that no attempt will close (each holds the env server's memory, and
sometimes a sandbox, until it is closed).

An attempt closes its own instance when it ends, and the next attempt of an episode closes its
predecessor's before its own reset. What neither covers: an attempt whose worker was killed
on the episode's last allowed attempt (dead-lettered by the sweeper, no next attempt), or one
re-queued to a queue nobody serves for a while. The sweeper pushes such instances to
``<prefix>:orphans``; this duty, on every worker process, pops a few each round and closes
them (``DELETE``, 200 even for an unknown id, so a second close is harmless; an ORS session's
``POST /delete``, likewise).

An entry's ``base_url`` came from a job, through Redis: it gets the same checks as the job's
own calls (broker/urls.py and the worker's env host allow-list), and is dropped unsent when
it fails them.
"""

from __future__ import annotations

import logging

import redis

from broker.duty import Duty
from broker.keys import Keys
from broker.records import OrphanInstance, RecordError, unpack
from broker.settings import redact_url
from broker.urls import url_problem
from workers.allowlist import HostAllowlist
from workers.envclient import EnvClient

log = logging.getLogger("interactor.orphans")

BATCH = 20


class OrphanCloser(Duty):
    name = "orphan-closer"

    def __init__(self, client: redis.Redis, keys: Keys, env: EnvClient, interval_s: float = 2.0,
                 env_hosts: HostAllowlist | None = None):
        super().__init__(interval_s)
        self.r = client
        self.keys = keys
        self.env = env
        self.env_hosts = env_hosts or HostAllowlist("")
        self.closed = 0
        self.refused = 0

    def tick(self) -> None:
        for raw in self.r.lpop(self.keys.orphans, BATCH) or []:
            try:
                orphan = unpack(raw)
                if not isinstance(orphan, OrphanInstance):
                    raise RecordError(f"expected an orphan_instance, got {orphan.KIND}")
            except RecordError as exc:
                log.warning("dropping an unreadable orphan entry: %s", exc)
                continue
            if orphan.base_url:
                if not self.env_hosts.allows(orphan.base_url):
                    self.refused += 1
                    log.warning("not closing orphan %s at %s: %s", orphan.instance_id, redact_url(orphan.base_url),
                                url_problem(orphan.base_url) or f"not on INTERACTOR_ENV_HOSTS ({self.env_hosts})")
                    continue
                self.env.close(orphan.base_url, orphan.env_name, orphan.instance_id,  # never raises
                               protocol=orphan.protocol)
                self.closed += 1
