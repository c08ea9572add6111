"""workers/limits.py: the per-process model concurrency cap, connection pool size and
first-wave start-up jitter."""

from __future__ import annotations

import random
import threading
import time

import pytest

from broker import errors
from broker.settings import Settings
from workers import limits
from workers.limits import FirstWaveJitter, LimitedPolicy, ModelGate, model_session, shared_gate

pytestmark = pytest.mark.unit  # needs no server: make check runs it


class SlowPolicy:
    def __init__(self, delay: float = 0.05):
        self.delay = delay
        self.lock = threading.Lock()
        self.now = 0
        self.peak = 0

    def complete(self, messages):
        with self.lock:
            self.now += 1
            self.peak = max(self.peak, self.now)
        time.sleep(self.delay)
        with self.lock:
            self.now -= 1
        return "ok"


def test_gate_caps_requests_in_flight_across_threads():
    gate, inner = ModelGate(3), SlowPolicy()
    deadline = time.monotonic() + 30
    results = []

    def episode():
        policy = LimitedPolicy(inner, gate, deadline)  # one wrapper per episode, one gate per process
        for _ in range(3):
            results.append(policy.complete([{"role": "user", "content": "x"}]))

    threads = [threading.Thread(target=episode) for _ in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == ["ok"] * 30
    assert inner.peak == 3 and gate.peak == 3 and gate.in_flight == 0 and gate.waits > 0


def test_gate_wait_respects_deadline_and_check():
    gate = ModelGate(1)
    gate.acquire(time.monotonic() + 5)
    t0 = time.monotonic()
    with pytest.raises(errors.EpisodeError) as info:
        gate.acquire(time.monotonic() + 0.3)
    assert info.value.reason == errors.EPISODE_TIMEOUT and 0.25 < time.monotonic() - t0 < 1.5

    def lost():
        raise errors.EpisodeError(errors.LEASE_LOST, "taken over")

    with pytest.raises(errors.EpisodeError) as info:
        gate.acquire(time.monotonic() + 5, check=lost)
    assert info.value.reason == errors.LEASE_LOST
    gate.release()
    gate.acquire(time.monotonic() + 1)  # free again
    gate.release()


def test_slot_is_released_when_the_call_fails():
    class Failing:
        def complete(self, messages):
            raise errors.EpisodeError(errors.MODEL_UNAVAILABLE, "down")

    gate = ModelGate(1)
    with pytest.raises(errors.EpisodeError):
        LimitedPolicy(Failing(), gate, time.monotonic() + 5).complete([])
    assert gate.in_flight == 0
    gate.acquire(time.monotonic() + 0.1)


def test_shared_gate_is_per_process_and_optional():
    assert shared_gate(0) is None
    assert LimitedPolicy(SlowPolicy(0), None, 0).complete([]) == "ok"  # no gate: straight through
    assert shared_gate(7) is shared_gate(7) is not shared_gate(8)


def test_model_session_pool_size():
    def pool(s):
        return model_session(s).get_adapter("http://x")._pool_maxsize

    assert pool(Settings.from_env({}, llm_max_connections=5)) == 5
    assert pool(Settings.from_env({}, concurrency=16)) == 32
    assert pool(Settings.from_env({}, concurrency=64, llm_max_concurrency=8)) == 16
    assert pool(Settings.from_env({}, concurrency=2)) == 10


def test_first_wave_jitter():
    j = FirstWaveJitter(2.0, 4, rng=random.Random(1))
    delays = [j.delay() for _ in range(6)]
    assert all(0 <= d <= 2.0 for d in delays[:4]) and len(set(delays[:4])) == 4
    assert delays[4:] == [0.0, 0.0], "only the first wave waits"
    assert FirstWaveJitter(0, 4).delay() == 0.0
    j = FirstWaveJitter.from_settings(Settings.from_env({}, llm_startup_jitter_s=1.5, concurrency=3))
    assert (j.max_s, j.left) == (1.5, 3)


def test_first_wave_jitter_wait_sleeps_in_slices_and_can_abort():
    slept, checks = [], []
    j = FirstWaveJitter(1.0, 1, rng=random.Random(3))
    total = j.wait(check=lambda: checks.append(1), sleep=lambda s: (slept.append(s), time.sleep(s)))
    assert 0 < total <= 1.0 and all(s <= limits._SLICE_S + 1e-9 for s in slept) and len(checks) >= len(slept)

    def shutting_down():
        raise errors.EpisodeError(errors.WORKER_SHUTDOWN, "bye")

    with pytest.raises(errors.EpisodeError):
        FirstWaveJitter(5.0, 1).wait(check=shutting_down)
