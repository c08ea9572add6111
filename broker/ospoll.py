"""``select.poll`` as the operating system provides it, even where gevent patched ``select``.

A zero-timeout readiness check (is a pooled connection still clean? did the server close an
idle one?) never waits, so it needs none of gevent's machinery; gevent's ``poll`` builds hub
watchers and a timeout for every call, which cost a visible share of a worker's CPU when done
for every HTTP call and every Redis command. Only for ``poll(0)``: anything that may wait must
go through gevent.
"""

from __future__ import annotations

import select
import sys


def os_poll():
    """A new poll object of the OS's own ``select.poll``."""
    if "gevent" in sys.modules:
        from gevent import monkey

        return monkey.get_original("select", "poll")()
    return select.poll()


class ReadyCheck:
    """``ready()``: does ``sock`` have something to read (data, EOF or an error) right now?
    The poll object is kept with its socket, so a check is one syscall."""

    __slots__ = ("sock", "_poller")

    def __init__(self, sock):
        self.sock = sock
        self._poller = os_poll()
        self._poller.register(sock, select.POLLIN | select.POLLPRI)

    def ready(self) -> bool:
        return bool(self._poller.poll(0))
