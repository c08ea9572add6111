"""A worker process's side of the fleet-wide caps (broker/caps.py): wait for slots, hold them
around calls, renew them while held.

* :class:`FleetGate`: one per process. ``acquire`` costs one Redis round trip when the caps
  have room. When they are full, the process's waiters for the same caps queue locally and
  only the one at the head asks Redis, with a growing pause between asks (10 ms to 200 ms,
  jittered), woken early when this process releases one of those slots: a process with 200
  episodes waiting costs Redis a few calls a second, not 200 busy loops. Waiting pauses the
  attempt's budget (a full cap is not the episode's doing) and runs ``check`` between slices
  (lease lost, shutdown).
* :class:`CappedPolicy`, :class:`CappedEnv`: the loop's ports with a slot held around each
  call; ``CappedEnv`` also holds an env-instance slot from reset to close.
* :class:`SlotRenewer`: renews every held slot every third of the TTL (one round trip for
  all of them), started with the first slot taken; a process that dies or freezes stops
  renewing and its slots lapse within the TTL.

What it costs Redis: a capped call whose caps have room, one round trip to take its slots
(every cap the call needs, in one script) and one to give them back; a process, one round
trip per third of the TTL to renew all the slots it holds. A job without caps gets none of
this: the runtime wraps no port, and no call costs a round trip.
"""

from __future__ import annotations

import itertools
import logging
import random
import threading
import time
from typing import Any, Callable, Sequence

import redis

from broker.caps import Cap, FleetSlots
from broker.duty import Duty
from workers.budget import Budget

log = logging.getLogger("interactor.fleetcaps")

_SLICE_S = 0.25  # waits are cut into slices so that `check` runs between them
_POLL_MIN_S, _POLL_MAX_S = 0.01, 0.2
_CLOSE_WAIT_S = 10.0  # a close waits this long at most for a call slot, then goes without one


class _Line:
    """The process's waiters for one set of caps: one asks Redis at a time."""

    def __init__(self, keys: frozenset[str]):
        self.keys = keys
        self.head = threading.Lock()
        self.freed = threading.Event()


class SlotRenewer(Duty):
    name = "fleet-slot-renewer"

    def __init__(self, gate: "FleetGate", interval_s: float):
        super().__init__(interval_s)
        self.gate = gate

    def tick(self) -> None:
        held = self.gate.held()
        lapsed = self.gate.slots.renew(held)
        for i in lapsed:
            key, holder = held[i]
            log.warning("fleet slot %s of %s lapsed before it was renewed (this process stalled, or Redis was "
                        "away); the cap may be exceeded by this call until it ends", holder, key)


class FleetGate:
    def __init__(self, slots: FleetSlots, name: str, ttl_s: float):
        self.slots = slots
        self.name = name
        self.ttl_s = ttl_s
        self._seq = itertools.count(1)
        self._lock = threading.Lock()
        self._held: dict[str, list[str]] = {}  # holder -> cap keys
        self._lines: dict[frozenset[str], _Line] = {}
        self._renewer: SlotRenewer | None = None
        self.waits = 0  # acquisitions that found a cap full

    def held(self) -> list[tuple[str, str]]:
        with self._lock:
            return [(key, holder) for holder, keys in self._held.items() for key in keys]

    def _line(self, caps: Sequence[Cap]) -> _Line:
        keys = frozenset(c.key for c in caps)
        with self._lock:
            line = self._lines.get(keys)
            if line is None:
                line = self._lines[keys] = _Line(keys)
            return line

    def _took(self, caps: Sequence[Cap], holder: str) -> str:
        with self._lock:
            self._held[holder] = [c.key for c in caps]
            if self._renewer is None:
                self._renewer = SlotRenewer(self, max(0.2, self.ttl_s / 3)).start()
        return holder

    def acquire(self, caps: Sequence[Cap], check: Callable[[], None], budget: Budget | None,
                max_wait_s: float | None = None) -> str | None:
        """Take a slot of every cap in ``caps``; returns the holder name to release with.
        Raises what ``check`` raises; with ``max_wait_s``, returns None when that passed."""
        holder = f"{self.name}:{next(self._seq)}"
        if self.slots.try_acquire(caps, holder) == 0:
            return self._took(caps, holder)
        with self._lock:
            self.waits += 1
        line = self._line(caps)
        t0 = last = time.monotonic()

        def waited() -> bool:
            nonlocal last
            now = time.monotonic()
            if budget is not None:
                budget.pause(now - last)
            last = now
            return max_wait_s is not None and now - t0 > max_wait_s

        while not line.head.acquire(timeout=_SLICE_S):  # another waiter of this process asks Redis
            check()
            if waited():
                return None
        try:
            delay = _POLL_MIN_S
            while True:
                check()
                line.freed.clear()
                if self.slots.try_acquire(caps, holder) == 0:
                    return self._took(caps, holder)
                if waited():
                    return None
                line.freed.wait(random.uniform(delay / 2, delay))
                delay = min(_POLL_MAX_S, delay * 2)
        finally:
            line.head.release()

    def release(self, caps: Sequence[Cap], holder: str | None) -> None:
        if holder is None:
            return
        with self._lock:
            self._held.pop(holder, None)
            keys = {c.key for c in caps}
            woken = [line for k, line in self._lines.items() if k & keys]
        try:
            self.slots.release(caps, holder)
        except redis.RedisError as exc:  # the slot lapses within the TTL instead
            log.warning("could not release fleet slot %s (%s); it lapses within the lease TTL", holder, exc)
        finally:
            for line in woken:
                line.freed.set()

    def stop(self) -> None:
        if self._renewer is not None:
            self._renewer.stop()


class CappedPolicy:
    """The policy port with a slot of the model caps held around each call."""

    def __init__(self, inner: Any, gate: FleetGate, caps: list[Cap], check: Callable[[], None], budget: Budget):
        self.inner, self.gate, self.caps, self.check, self.budget = inner, gate, caps, check, budget

    def complete(self, messages: list[dict]) -> Any:
        holder = self.gate.acquire(self.caps, self.check, self.budget)
        try:
            return self.inner.complete(messages)
        finally:
            self.gate.release(self.caps, holder)


class CappedEnv:
    """The env port with a slot of the call caps held around each call, and one of the
    instance caps from reset to close."""

    def __init__(self, inner: Any, gate: FleetGate, call_caps: list[Cap], instance_caps: list[Cap],
                 check: Callable[[], None], budget: Budget):
        self.inner, self.gate, self.check, self.budget = inner, gate, check, budget
        self.call_caps, self.instance_caps = call_caps, instance_caps
        self._instance: str | None = None

    def _call(self, fn: Callable[[], Any]) -> Any:
        if not self.call_caps:
            return fn()
        holder = self.gate.acquire(self.call_caps, self.check, self.budget)
        try:
            return fn()
        finally:
            self.gate.release(self.call_caps, holder)

    def reset(self):
        if self.instance_caps and self._instance is None:
            self._instance = self.gate.acquire(self.instance_caps, self.check, self.budget)
        return self._call(self.inner.reset)

    def get_task_prompt(self):
        return self._call(self.inner.get_task_prompt)

    def step(self, action: str):
        return self._call(lambda: self.inner.step(action))

    def close(self) -> None:
        """Always closes (an attempt that is ending must not leak its instance): it waits for a
        call slot only a little, and never raises what ``check`` would."""
        try:
            holder = None
            if self.call_caps:
                try:
                    holder = self.gate.acquire(self.call_caps, lambda: None, None, max_wait_s=_CLOSE_WAIT_S)
                except redis.RedisError:
                    holder = None  # Redis away: close without a slot rather than leave the instance
            try:
                self.inner.close()
            finally:
                self.gate.release(self.call_caps, holder)
        finally:
            if self._instance is not None:
                self.gate.release(self.instance_caps, self._instance)
                self._instance = None
