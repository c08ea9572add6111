"""A worker process's side of the fleet-wide caps (broker/caps.py): slots taken from Redis in
blocks, lent to this process's calls, given back when not needed.

Taking a slot from Redis for every call and giving it back after cost two round trips a
call: at 20-step episodes that doubled the orchestration CPU per step (docs/benchmarks.md,
"Cost of the fleet-wide caps"). So a process keeps, per set of caps, a :class:`_Pool` of
slots it holds in Redis, and lends them to its calls locally:

* **borrow** (``acquire``): a free slot of the pool, no round trip. When there is none, one
  waiter of the pool at a time asks Redis for a block: as many as are waiting, or as many
  as the pool holds already (doubling while the load ramps up), at most :data:`BLOCK_MAX`.
  A cap that has no room grants fewer or none; the waiter asks again after a growing pause
  (10 ms to 200 ms, jittered), woken early when this process frees a slot of the pool.
  Waiting pauses the attempt's budget (a full cap is not the episode's doing) and runs
  ``check`` between slices (lease lost, shutdown).
* **return** (``release``): back to the pool, and to a waiter of it if there is one; when
  another process waits and no call of this one does, back to Redis at once.
* **keeper** (:class:`SlotKeeper`, every :data:`RENEW_S`): one round trip renews every
  pool's lease and learns whether another process waits for its caps; slots a pool did not
  need for the whole tick go back to Redis. When one does, a pool keeps no more than its fair
  share (the cap over the processes taking part): what it frees above that goes back at once.
  When more processes take part than the cap has slots (share 0), the pool keeps one slot for
  a turn (:attr:`FleetGate.turn_s`, one keeper tick) from when it came to hold any, then
  gives back each slot as its call ends, and waits in Redis' queue behind those that waited
  longer (broker/caps.py). So a busy process cannot starve the others for more than about
  a tick and a turn, plus its calls in flight, whatever the cap.

A process that dies or freezes stops renewing and its slots lapse within the lease TTL. A
Redis outage does not free them (broker/caps.py: sweeps are held after one, and a renewal
extends a lapsed lease nobody swept). One that learns its slots lapsed (a renewal or a take
says so) holds none from then: calls already running finish, and new ones wait until what
is in use fits what it takes anew.

What it costs Redis in the steady state: one round trip per process per :data:`RENEW_S`,
and one when the load grows or shrinks a block, instead of two a call (docs/benchmarks.md,
"Cost of the fleet-wide caps", measures it per step). A job without caps gets none of this:
the runtime wraps no port, and no call costs a round trip.
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
from workers.adaptive_caps import AdaptiveReporter, LiveLimits, MetricsWatch
from workers.budget import Budget

log = logging.getLogger("interactor.fleetcaps")

RENEW_S = 1.0  # the keeper's tick: leases renewed, other processes' waiting learnt, idle slots given back
BLOCK_MAX = 64  # the most slots one take asks for
_SLICE_S = 0.25  # waits are cut into slices so that `check` runs between them
_POLL_MIN_S, _POLL_MAX_S = 0.01, 0.2
_CLOSE_WAIT_S = 10.0  # a close waits this long at most for a call slot, then goes without one


class _Pool:
    """This process's slots of one set of caps: ``held`` in Redis, ``lent`` to calls now."""

    def __init__(self, caps: Sequence[Cap], holder: str, lock: threading.Lock):
        self.caps = list(caps)
        self.holder = holder
        self.held = 0
        self.lent = 0
        self.waiting = 0
        self.asking = False  # a waiter is asking Redis for a block
        self.freed = threading.Condition(lock)
        self.idle_low = 0  # the fewest free slots since the keeper's last tick
        self.contended = False  # another process waits for one of these caps
        self.share = 0  # and then this pool keeps at most this many (0: it takes turns)
        self.turn_from = 0.0  # when it last came to hold slots, having held none (monotonic)
        self.short = False  # since the keeper's last tick, a take got fewer slots than calls waited

    @property
    def free(self) -> int:
        return self.held - self.lent


class SlotKeeper(Duty):
    name = "fleet-slot-keeper"

    def __init__(self, gate: "FleetGate", interval_s: float):
        super().__init__(interval_s)
        self.gate = gate

    def tick(self) -> None:
        self.gate.keep()


class FleetGate:
    """One per process: its pools, and the one lock its talks with Redis about them go under
    (so that what a pool holds is what Redis counts for it, one change at a time)."""

    def __init__(self, slots: FleetSlots, name: str, ttl_s: float, renew_s: float = RENEW_S):
        self.slots = slots
        self.name = name
        self.ttl_s = ttl_s
        self.renew_s = min(renew_s, ttl_s / 3)
        self.turn_s = self.renew_s  # how long a pool keeps a slot of a cap it takes turns at
        self._seq = itertools.count(1)
        self._lock = threading.Lock()  # the pools' counts; never held across a round trip
        self._io = threading.Lock()  # takes, gives and renewals, one at a time
        self._pools: dict[tuple[str, ...], _Pool] = {}
        self._keeper: SlotKeeper | None = None
        self.waits = 0  # borrows that found no free slot
        # adaptive caps and a job's live limits (workers/adaptive_caps.py), made when first asked for
        self._adaptive: AdaptiveReporter | None = None
        self._live: LiveLimits | None = None
        self._metrics: MetricsWatch | None = None
        self.round_trips = 0  # takes and gives (the keeper's renewals not counted)

    @property
    def adaptive(self) -> AdaptiveReporter:
        """This process's reporter of outcomes under adaptive caps; the keeper flushes it."""
        with self._lock:
            if self._adaptive is None:
                self._adaptive = AdaptiveReporter(self.slots.r, self.slots.k)
            return self._adaptive

    @property
    def metrics(self) -> MetricsWatch:
        """This process's reads of model servers' metrics (``--llm-metrics-url``), on their own
        duty thread: a slow endpoint never holds up the keeper's lease renewals."""
        reporter = self.adaptive
        with self._lock:
            if self._metrics is None:
                self._metrics = MetricsWatch(self.slots.r, self.slots.k, reporter)
                self._metrics.start()
            return self._metrics

    @property
    def live(self) -> LiveLimits:
        """The jobs' live limits (``interactor job JOB set``), read every few seconds at most."""
        with self._lock:
            if self._live is None:
                self._live = LiveLimits(self.slots.r, self.slots.k)
            return self._live

    def _pool(self, caps: Sequence[Cap]) -> _Pool:
        key = tuple(sorted(c.key for c in caps))
        with self._lock:
            pool = self._pools.get(key)
            if pool is None:
                pool = self._pools[key] = _Pool(caps, f"{self.name}:{next(self._seq)}", self._lock)
                if self._keeper is None:
                    self._keeper = SlotKeeper(self, self.renew_s).start()
            return pool

    def acquire(self, caps: Sequence[Cap], check: Callable[[], None], budget: Budget | None,
                max_wait_s: float | None = None) -> str | None:
        """Borrow a slot of every cap in ``caps``; returns a token to release with. Raises what
        ``check`` raises; with ``max_wait_s``, returns None when that passed."""
        pool = self._pool(caps)
        with self._lock:
            if pool.free > 0:
                return self._lend(pool)
            pool.waiting += 1
            self.waits += 1
        t0 = last = time.monotonic()
        delay = _POLL_MIN_S
        i_ask = False  # this waiter is the one of the pool that asks Redis, until it is served
        try:
            while True:
                check()
                now = time.monotonic()
                if budget is not None:
                    budget.pause(now - last)
                last = now
                if max_wait_s is not None and now - t0 > max_wait_s:
                    return None
                with self._lock:
                    if pool.free > 0:
                        return self._lend(pool)
                    if pool.asking and not i_ask:  # another waiter of this process asks Redis
                        pool.freed.wait(_SLICE_S)
                        continue
                    pool.asking = i_ask = True
                    want = min(BLOCK_MAX, max(pool.waiting, pool.held, 1))
                    waiting = pool.waiting
                granted = self._take(pool, want)
                if granted < waiting:  # the cap is full: this process's demand reaches its limit
                    pool.short = True
                if granted:
                    with self._lock:  # the others may take what came; this one asks no more
                        pool.asking = i_ask = False
                        pool.freed.notify_all()
                    delay = max(_POLL_MIN_S, delay / 2)  # a cap that had room may well be full again
                    continue
                # Nothing came: this waiter stays the asker through its pause, so that the
                # others of the pool wait for it instead of each asking in turn.
                with self._lock:
                    if pool.free <= 0:
                        pool.freed.wait(random.uniform(delay / 2, delay))
                delay = min(_POLL_MAX_S, delay * 2)
        finally:
            with self._lock:
                pool.waiting -= 1
                if i_ask:
                    pool.asking = False
                    pool.freed.notify_all()

    def _lend(self, pool: _Pool) -> str:  # under the lock
        pool.lent += 1
        pool.idle_low = min(pool.idle_low, pool.free)
        return pool.holder

    def _take(self, pool: _Pool, want: int) -> int:
        """Ask Redis for ``want`` slots of the pool's caps; returns how many came."""
        with self._io:
            granted, before = self.slots.take(pool.caps, pool.holder, want)
            self.round_trips += 1
            with self._lock:
                if before != pool.held:  # swept: its lease lapsed (this process stalled, or cut off from Redis)
                    self._lapsed(pool, before)
                if pool.held == 0 and granted > 0:
                    pool.turn_from = time.monotonic()
                pool.held += granted
        return granted

    def _lapsed(self, pool: _Pool, counted: int) -> None:  # under the lock
        log.warning("fleet slots of %s lapsed (held %d, Redis counts %d): this process stalled, or could not "
                    "reach Redis while others did; the %d calls running now may exceed the cap until they end",
                    pool.holder, pool.held, max(0, counted), pool.lent)
        pool.held = max(0, counted)
        pool.idle_low = 0

    def _over_share(self, pool: _Pool) -> int:
        """Under the lock: the free slots a contended pool (another process waits) gives back
        now: all of them when no call of this process waits, else those above what it keeps:
        its share, or, when more processes take part than the cap has slots (share 0), one
        slot for a turn of :attr:`turn_s`, then none (the others come first: broker/caps.py)."""
        if not pool.contended:
            return 0
        if not pool.waiting:
            return pool.free
        keep = pool.share or int(time.monotonic() - pool.turn_from < self.turn_s)
        return max(0, min(pool.free, pool.held - keep))

    def release(self, caps: Sequence[Cap], token: str | None) -> None:
        if token is None:
            return
        pool = self._pool(caps)
        with self._lock:
            pool.lent -= 1
            over = self._over_share(pool) > 0
            if not over and pool.waiting:
                pool.freed.notify()
        if over:  # another process waits for these caps: the slot goes to Redis, not to a waiter here
            with self._io:
                with self._lock:
                    give = max(0, self._over_share(pool))
                    pool.held -= give
                    if pool.waiting and pool.free > 0:
                        pool.freed.notify()
                self._give(pool, give)

    def _give(self, pool: _Pool, count: int) -> None:  # under the io lock, its count already taken off
        if count <= 0:
            return
        try:
            self.slots.give(pool.caps, pool.holder, count)
            self.round_trips += 1
        except redis.RedisError as exc:  # Redis still counts them: the next renewal says so
            log.warning("could not give back %d fleet slots of %s (%s)", count, pool.holder, exc)

    def keep(self) -> None:
        """The keeper's tick: renew every pool's lease (one round trip), then give back what no
        call needed since the last tick, and what is above a contended pool's share; then the
        tick's outcomes under adaptive caps, with the caps whose calls waited (workers/adaptive_caps.py)."""
        self._renew()
        if self._adaptive is not None:
            with self._lock:
                demand = {c.key for p in self._pools.values() if p.short or p.waiting for c in p.caps}
                for p in self._pools.values():
                    p.short = False
            self._adaptive.flush(demand)

    def _renew(self) -> None:
        with self._io:
            with self._lock:
                pools = [p for p in self._pools.values() if p.held > 0]
            if not pools:
                return
            answers = self.slots.renew([(p.holder, p.caps) for p in pools])
            gives = []
            with self._lock:
                for pool, ans in zip(pools, answers):
                    if ans.held < 0:
                        self._lapsed(pool, 0)
                    elif ans.held != pool.held:  # a give that failed: Redis still counts them
                        pool.held = ans.held
                    pool.contended, pool.share = ans.contended, ans.share
                    spare = 0 if pool.waiting else min(pool.idle_low, pool.free)
                    spare = max(spare, self._over_share(pool))
                    if spare > 0:
                        pool.held -= spare
                        gives.append((pool, spare))
                    pool.idle_low = pool.free
            for pool, count in gives:
                self._give(pool, count)

    def stop(self) -> None:
        """Give every slot back (a process that stops must not keep them until they lapse)."""
        if self._keeper is not None:
            self._keeper.stop()
        if self._metrics is not None:
            self._metrics.stop()
        with self._io:
            with self._lock:
                gives = [(p, p.free) for p in self._pools.values() if p.free > 0]
                for p, n in gives:
                    p.held -= n
            for pool, count in gives:
                self._give(pool, count)  # one that fails lapses within the TTL


class CappedPolicy:
    """The policy port with a slot of the model caps held around each call."""

    def __init__(self, inner: Any, gate: FleetGate, caps: list[Cap], check: Callable[[], None], budget: Budget):
        self.inner, self.gate, self.caps, self.check, self.budget = inner, gate, caps, check, budget

    def complete(self, messages: list[dict], **request: Any) -> Any:
        holder = self.gate.acquire(self.caps, self.check, self.budget)
        try:
            return self.inner.complete(messages, **request)
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
        self.adopt()
        return self._call(self.inner.reset)

    def adopt(self) -> None:
        """Hold a slot of the instance caps for this port's instance: at its reset, or before the
        first call on an instance a predecessor left live (a resumed trajectory), which counts
        against the cap as any other."""
        if self.instance_caps and self._instance is None:
            self._instance = self.gate.acquire(self.instance_caps, self.check, self.budget)

    def get_task_prompt(self):
        return self._call(self.inner.get_task_prompt)

    def step(self, action: str, **tool_calls: Any):
        return self._call(lambda: self.inner.step(action, **tool_calls))

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
