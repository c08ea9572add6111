"""The fleet-wide caps' slots (broker/caps.py) and a process's pools of them
(workers/fleetcaps.py), against a real Redis: gates stand for worker processes here, each
with its own Redis connection; tests/test_fleet_limits.py runs the caps in real workers.

Nothing asserts on speed: the figures checked are counts (slots, calls in flight, round
trips).
"""

from __future__ import annotations

import threading
import time

import pytest

from broker.caps import CAP_ENV, CAP_MODEL, Cap, FleetSlots
from broker.keys import Keys
from broker.redisconn import connect
from tests.conftest import wait_for
from workers.fleetcaps import FleetGate

pytestmark = [pytest.mark.integration]


def _no_check() -> None:
    return None


def test_takes_are_all_or_none_give_back_and_lapse_without_renewal(settings):
    client = connect(settings)
    keys = Keys(settings.key_prefix)
    slots = FleetSlots(client, keys, ttl_ms=1000)
    a, b = Cap.of(keys, CAP_MODEL, "m", 5), Cap.of(keys, CAP_ENV, "e", 2)
    assert slots.take([a, b], "h1", 3) == (2, 0)  # b has room for 2: 2 of each, not 3 of a
    assert slots.take([a, b], "h2", 1) == (0, 0)  # b is full: nothing of a either
    assert client.zscore(b.wanted, "h2") is not None, "a holder that got fewer than it wanted is noted as waiting"
    assert slots.take([a], "h3", 9) == (3, 0)  # the rest of a
    assert [u["in_use"] for u in _use(slots, [a, b])] == [5, 2]
    slots.give([a, b], "h1", 1)
    assert slots.take([a, b], "h2", 1) == (1, 0)
    assert client.zscore(b.wanted, "h2") is None, "a holder that got what it wanted is no longer waiting"
    assert slots.take([a, b], "h1", 1) == (0, 1), "a take tells what Redis counted for the holder"
    # renewals: h1 and h2 live, a holder Redis never saw is told its slots are gone
    told = slots.renew([("h1", [a, b]), ("nobody", [a]), ("h2", [a, b])])
    assert [t.held for t in told] == [1, -1, 1]
    slots.give([a, b], "h1", 1)  # all of h1's: it is gone from both caps
    assert client.hget(a.held, "h1") is None and client.zscore(a.key, "h1") is None
    # Nobody takes or renews for longer than the TTL: every lease lapses, and the caps' clock
    # shows a gap, which may be a Redis outage that the holders could not renew through. Their
    # slots are kept (h5 gets what was free), and one that renews now keeps its own.
    time.sleep(1.3)
    assert slots.take([a, b], "h5", 2) == (1, 0)
    assert [t.held for t in slots.renew([("h3", [a])])] == [3], "a lapsed lease nobody swept is renewed"
    # Two TTLs on, with the clock kept going (h5 renews, h6 asks), those that never came back
    # (h2) are swept: h6 gets b's slot.
    wait_for(lambda: slots.renew([("h5", [a, b]), ("h3", [a])]) and slots.take([a, b], "h6", 1)[0] == 1,
             timeout=10, interval=0.1, what="h2's lapsed slots to be swept once the hold passed")
    assert client.hget(b.held, "h2") is None
    assert [u["in_use"] for u in _use(slots, [a, b])] == [5, 2]


def _use(slots: FleetSlots, caps: list[Cap]) -> list[dict]:
    slots.register(caps)
    by_key = {(u["kind"], u["name"]): u for u in slots.use()}
    return [by_key[(k, n)] for k, n in ((CAP_MODEL, "m"), (CAP_ENV, "e"))][:len(caps)]


def test_waiters_are_queued_in_arrival_order_within_one_millisecond(settings):
    """Redis' clock has millisecond steps and a sorted set orders equal scores by name, so two
    waiters queued in one millisecond went by name ("a" before "z"), not arrival. The queue's
    last place is set here past Redis' clock, as a second waiter in the same millisecond sees
    it: the next one still goes behind it."""
    client = connect(settings)
    keys = Keys(settings.key_prefix)
    slots = FleetSlots(client, keys, ttl_ms=10_000, wanted_ttl_ms=60_000)
    a = Cap.of(keys, CAP_MODEL, "m", 1)
    _lease, _held, wanted, queue = a.quadruple
    assert slots.take([a], "holder", 1) == (1, 0)
    assert slots.take([a], "z", 1) == (0, 0)
    place = float(client.zscore(queue, "z")) + 5_000  # "z" queued at what the clock says next
    client.zadd(queue, {"z": place})
    client.zadd(wanted, {"z": place + 60_000})
    assert slots.take([a], "a", 1) == (0, 0)
    assert [m.decode() for m in client.zrange(queue, 0, -1)] == ["z", "a"]
    slots.give([a], "holder", 1)
    assert slots.take([a], "a", 1) == (0, 0), "z came first"
    assert slots.take([a], "z", 1) == (1, 0)


def test_renewal_tells_a_holder_another_waits_and_its_share(settings):
    client = connect(settings)
    keys = Keys(settings.key_prefix)
    slots = FleetSlots(client, keys, ttl_ms=5000)
    a = Cap.of(keys, CAP_MODEL, "m", 10)
    assert slots.take([a], "busy", 10) == (10, 0)
    (alone,) = slots.renew([("busy", [a])])
    assert (alone.held, alone.contended) == (10, False)
    assert slots.take([a], "late", 4) == (0, 0)
    (told,) = slots.renew([("busy", [a])])
    assert (told.held, told.contended, told.share) == (10, True, 5), told


def test_waiters_holding_none_are_served_in_the_order_they_came(settings):
    """Under a cap of 1, the waiters that hold none are served in the order they began to
    wait, whoever asks first once the slot is free; a holder is told its share is 0 when more
    take part than the cap has slots (it then keeps its slot for a turn only)."""
    client = connect(settings)
    keys = Keys(settings.key_prefix)
    # waiters that stop asking are forgotten after wanted_ttl_ms: long here, for a busy machine
    slots = FleetSlots(client, keys, ttl_ms=10_000, wanted_ttl_ms=60_000)
    a = Cap.of(keys, CAP_MODEL, "m", 1)
    assert slots.take([a], "x", 1) == (1, 0)
    assert slots.take([a], "y", 1) == (0, 0)  # y waits first
    assert slots.take([a], "z", 1) == (0, 0)  # then z
    (told,) = slots.renew([("x", [a])])
    assert (told.held, told.contended, told.share) == (1, True, 0), told
    slots.give([a], "x", 1)
    assert slots.take([a], "x", 1) == (0, 0), "x had its turn: it queues behind y and z"
    assert slots.take([a], "z", 1) == (0, 0), "y waited longer"
    assert slots.take([a], "y", 1) == (1, 0)
    slots.give([a], "y", 1)
    assert slots.take([a], "x", 1) == (0, 0), "z waited longer"
    assert slots.take([a], "z", 1) == (1, 0)


def _calls(gate: FleetGate, caps: list[Cap], n: int, hold_s: float, live: dict, lock: threading.Lock,
           errors: list) -> list[threading.Thread]:
    """``n`` threads, each borrowing a slot, holding it ``hold_s`` (counting the calls in
    flight across every gate), ten times over."""

    def one() -> None:
        try:
            for _ in range(10):
                token = gate.acquire(caps, _no_check, None)
                with lock:
                    live["now"] += 1
                    live["peak"] = max(live["peak"], live["now"])
                    live["calls"] += 1
                time.sleep(hold_s)
                with lock:
                    live["now"] -= 1
                gate.release(caps, token)
        except Exception as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    return [threading.Thread(target=one, daemon=True) for _ in range(n)]


def _run_gates(settings, cap_n: int, gates_n: int, callers: int, hold_s: float) -> tuple[dict, int]:
    keys = Keys(settings.key_prefix)
    cap = Cap.of(keys, CAP_MODEL, "m", cap_n)
    gates = [FleetGate(FleetSlots(connect(settings), keys, 10_000), f"host-{i}", 10.0) for i in range(gates_n)]
    live, lock, errors = {"now": 0, "peak": 0, "calls": 0}, threading.Lock(), []
    threads = [t for g in gates for t in _calls(g, [cap], callers, hold_s, live, lock, errors)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert live["calls"] == gates_n * callers * 10, live
    trips = sum(g.round_trips for g in gates)
    client = connect(settings)
    wait_for(lambda: int(sum(int(v) for v in client.hvals(cap.held))) == 0, timeout=10,
             what="the gates to give back the slots no call needs")
    for g in gates:
        g.stop()
    return live, trips


def test_a_binding_cap_holds_across_gates(settings):
    """Three gates (processes) with 12 callers each under a cap of 8: never more than 8 calls
    in flight, every call made, and every slot given back after."""
    live, trips = _run_gates(settings, 8, 3, 12, 0.01)
    print(f"\n[fleet slots] binding: {live['calls']} calls, peak {live['peak']} in flight (cap 8), {trips} round trips")
    assert 1 <= live["peak"] <= 8, live
    # the waiters of a gate queue behind one asker, and a gate whose burst ended gives its
    # slots back at once: the slots change hands far less often than once a call
    assert trips < live["calls"], f"{trips} round trips for {live['calls']} calls"


def test_calls_under_a_cap_with_room_cost_no_round_trip_each(settings):
    """The same load under a cap with room (100): the gates take blocks and lend them, so
    they ask Redis far less than once a call (the old way: twice a call)."""
    live, trips = _run_gates(settings, 100, 3, 12, 0.01)
    print(f"\n[fleet slots] with room: {live['calls']} calls, peak {live['peak']} in flight, {trips} round trips")
    assert trips < live["calls"] / 4, f"{trips} round trips for {live['calls']} calls: the pools do not lend"


def test_a_busy_gate_gives_way_to_a_waiting_one(settings):
    """One gate keeps a cap of 6 busy with 20 callers; a second gate's caller still gets a
    slot soon (the busy one keeps no more than its share once the other waits)."""
    keys = Keys(settings.key_prefix)
    cap = Cap.of(keys, CAP_MODEL, "m", 6)
    busy = FleetGate(FleetSlots(connect(settings), keys, 10_000), "host-busy", 10.0)
    other = FleetGate(FleetSlots(connect(settings), keys, 10_000), "host-other", 10.0)
    stop = threading.Event()

    def hog() -> None:
        while not stop.is_set():
            token = busy.acquire([cap], _no_check, None)
            time.sleep(0.02)
            busy.release([cap], token)

    hogs = [threading.Thread(target=hog, daemon=True) for _ in range(20)]
    for t in hogs:
        t.start()
    wait_for(lambda: busy._pool([cap]).held == 6, timeout=30, what="the busy gate to hold the whole cap")
    got = []
    try:
        for _ in range(3):
            token = other.acquire([cap], _no_check, None, max_wait_s=30)
            got.append(token is not None)
            other.release([cap], token)
    finally:
        stop.set()
        for t in hogs:
            t.join(30)
    assert got == [True, True, True], got
    busy.stop()
    other.stop()


def test_a_gate_that_learns_its_slots_lapsed_holds_none(settings):
    """A gate whose lease lapsed (frozen past the TTL) holds nothing from then: the slots it
    thought it had are not lent again, and the cap is not exceeded once its calls end."""
    keys = Keys(settings.key_prefix)
    cap = Cap.of(keys, CAP_MODEL, "m", 2)
    slow = FleetGate(FleetSlots(connect(settings), keys, 1200), "host-slow", 1.2)
    token = slow.acquire([cap], _no_check, None)
    slow._keeper.stop()  # frozen: it renews no more
    assert slow._pool([cap]).held >= 1
    time.sleep(1.5)  # its lease lapses
    fresh = FleetGate(FleetSlots(connect(settings), keys, 10_000), "host-fresh", 10.0)
    tokens = [fresh.acquire([cap], _no_check, None, max_wait_s=10) for _ in range(2)]
    assert all(tokens), "the lapsed gate's slots came back to the cap"
    slow.keep()  # its renewal says they are gone
    pool = slow._pool([cap])
    assert pool.held == 0 and pool.lent == 1
    assert slow.acquire([cap], _no_check, None, max_wait_s=0.5) is None, "the cap is full: the slow gate waits"
    slow.release([cap], token)
    for t in tokens:
        fresh.release([cap], t)
    slow.stop()
    fresh.stop()
