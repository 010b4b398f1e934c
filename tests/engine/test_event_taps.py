"""``EventHub`` listeners (``tap``): what the step lanes hear of the reads they posted. A listener
sees every event after its delivery to the engine, a failing one costs the engine nothing, and
``untap`` stops it."""

from __future__ import annotations

import pytest

from kvsidecar.engine.events import EventHub
from kvsidecar.types import Event, RecvDone, SendDone


def _done(request_id: str) -> RecvDone:
    return RecvDone(request_id=request_id, bytes=1, duration_s=0.0)


def test_a_listener_sees_each_event_beside_the_engines_delivery() -> None:
    hub = EventHub()
    heard: list[Event] = []
    hub.tap(heard.append)
    first = hub.emit(_done("a"))
    second = hub.emit(SendDone(request_id="b", consumers=1, expected_consumers=1, expired=False))
    assert heard == [first, second]  # stamped, as the engine gets them
    assert hub.drain() == (first, second)
    hub.untap(heard.append)
    hub.untap(heard.append)  # twice: nothing
    hub.emit(_done("c"))
    assert len(heard) == 2


def test_a_failing_listener_costs_the_engine_nothing(caplog: pytest.LogCaptureFixture) -> None:
    hub = EventHub()
    heard: list[Event] = []

    def broken(event: Event) -> None:
        raise RuntimeError("a bug in a listener")

    hub.tap(broken)
    hub.tap(heard.append)
    event = hub.emit(_done("a"))
    assert hub.drain() == (event,)
    assert heard == [event]  # the next listener still hears it
    assert "an event listener failed" in caplog.text
