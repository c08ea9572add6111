"""The per-process watchdog that cuts the connection of an HTTP call still waiting for its
answer at its deadline (the attempt's budget), for both paths of workers/http_transport.py.

Socket timeouts bound each receive, not a call: a server that sends a byte now and then keeps
every receive short and the call going forever. The watchdog is the one bound on a whole call;
:mod:`workers.http_transport` arms it for each call's socket once the request is out and
disarms it when the call ends.
"""

from __future__ import annotations

import heapq
import socket
import threading
import time


class Watch:
    """One armed call: its deadline and socket; ``fired`` once the watchdog shut the socket."""

    __slots__ = ("deadline", "sock", "fired", "cancelled", "watchdog")

    def __init__(self, deadline: float, sock, watchdog: "Watchdog"):
        self.deadline, self.sock, self.fired, self.cancelled = deadline, sock, False, False
        self.watchdog = watchdog

    def cancel(self) -> None:
        """Never shut this socket down from now on (a no-op once disarmed)."""
        if not self.cancelled:
            self.watchdog.disarm(self)


class Watchdog:
    """Cuts the connection of a call still waiting for its answer at its deadline.

    One thread per process holds a heap of (deadline, socket) for the calls in flight and shuts
    down the socket of any that passes its deadline; the blocked read then ends, and the call
    reports the budget as spent. Arming and disarming cost a heap push and a flag; disarmed
    entries are dropped lazily, and the heap is rebuilt when they pile up.

    Firing and disarming happen under one lock: once ``disarm`` returns, the socket is not
    shut down by this watch, and a connection handed to the next call cancels the watch of
    the call before (``_Conn.watch`` in plainhttp.py, ``_Watched`` in http_transport.py), so a
    call that ends at its deadline cannot cut the next call's exchange on the same connection."""

    def __init__(self) -> None:
        self._heap: list = []
        self._cv = threading.Condition()
        self._cancelled = 0
        self._thread: threading.Thread | None = None

    def arm(self, deadline: float, sock) -> Watch:
        w = Watch(deadline, sock, self)
        with self._cv:
            heapq.heappush(self._heap, (deadline, id(w), w))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="http-watchdog", daemon=True)
                self._thread.start()
            elif self._heap[0][2] is w:
                self._cv.notify()
        return w

    def disarm(self, w: Watch) -> None:
        with self._cv:
            if w.cancelled:
                return
            w.cancelled = True
            self._cancelled += 1
            if self._cancelled > 1024 and self._cancelled * 2 > len(self._heap):
                self._heap = [e for e in self._heap if not e[2].cancelled]
                heapq.heapify(self._heap)
                self._cancelled = 0

    def _run(self) -> None:
        while True:
            with self._cv:
                heap = self._heap
                while heap and heap[0][2].cancelled:
                    heapq.heappop(heap)
                    self._cancelled = max(0, self._cancelled - 1)
                if not heap:
                    self._cv.wait()
                    continue
                wait = heap[0][0] - time.monotonic()
                if wait > 0:
                    self._cv.wait(wait)
                    continue
                w = heapq.heappop(heap)[2]
                w.fired = w.cancelled = True  # done: a later disarm has nothing to do
                try:  # under the lock: a disarm that returned has kept its socket whole
                    w.sock.shutdown(socket.SHUT_RDWR)
                except (OSError, AttributeError):
                    pass
