"""A breaker's outage clock: a server that flaps spends the outage budget only while it is down."""

from __future__ import annotations

import threading
import time

import pytest

from broker.errors import ENV_OUTAGE, EpisodeError
from workers.breakers import ENV, Breaker
from workers.budget import Budget

pytestmark = pytest.mark.unit  # needs no server: make check runs it


class Server:
    """The readiness answer a breaker's prober gets: up or down, as the test says."""

    def __init__(self):
        self.up = threading.Event()

    def probe(self) -> bool:
        return self.up.is_set()


def _wait_closed(breaker: Breaker, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while breaker.is_open:
        assert time.monotonic() < deadline, "the breaker never closed though the server answered"
        time.sleep(0.05)


def test_time_up_between_two_blips_is_not_counted_as_outage():
    server = Server()
    breaker = Breaker(ENV, "http://127.0.0.1:1", server.probe)
    breaker.trip("connection reset")
    time.sleep(0.3)
    server.up.set()  # back: the prober closes the breaker at its next probe
    _wait_closed(breaker)
    time.sleep(3.0)  # answering for a while, then down again within the flap window
    server.up.clear()
    breaker.trip("connection reset")
    # The same outage goes on (its start is the first one's) but its clock counts the time down
    # (about a second so far), not the three seconds the server answered in between.
    assert breaker.opened_at is not None
    assert time.monotonic() - breaker.opened_at < 2.5
    server.up.set()
    assert breaker.wait(lambda: None, Budget(60), outage_budget_s=2.5) >= 0.0
    assert not breaker.is_open


def test_a_server_down_for_longer_than_the_budget_ends_the_wait_as_an_outage():
    server = Server()
    breaker = Breaker(ENV, "http://127.0.0.1:1", server.probe)
    breaker.trip("connection refused")
    with pytest.raises(EpisodeError) as caught:
        breaker.wait(lambda: None, Budget(60), outage_budget_s=1.0)
    assert caught.value.reason == ENV_OUTAGE
    server.up.set()
    _wait_closed(breaker)


def test_flapping_downtime_adds_up_across_blips():
    server = Server()
    breaker = Breaker(ENV, "http://127.0.0.1:1", server.probe)
    breaker.trip("connection reset")
    time.sleep(1.2)
    server.up.set()
    _wait_closed(breaker)
    server.up.clear()
    breaker.trip("connection reset")
    # Down for over a second before, so a budget of one second is spent the moment it is down again.
    with pytest.raises(EpisodeError):
        breaker.wait(lambda: None, Budget(60), outage_budget_s=1.0)
    server.up.set()
    _wait_closed(breaker)
