"""A canary READ_DONE on the wire: its ranges and CRC survive the round trip, a READ_DONE without
one decodes to none, and ranges past their bound are refused naming the field."""

from __future__ import annotations

import pytest

from kvsidecar.errors import InvalidArgumentError
from kvsidecar.limits import MAX_CANARY_RANGES
from kvsidecar.plan.hold.canary import RANGE_BYTES
from kvsidecar.wire.peer import (
    Canary,
    NotificationKind,
    PeerNotification,
    notification_from_proto,
    notification_to_proto,
)


def _note(canary: Canary | None) -> PeerNotification:
    return PeerNotification(
        kind=NotificationKind.READ_DONE,
        remote_request_id="r",
        expected_consumers=1,
        epoch=3,
        consumer_engine_id="d",
        consumer_rank=0,
        token="t" * 24,
        confirm=True,
        canary=canary,
    )


def test_a_canary_survives_the_wire() -> None:
    canary = Canary(bytes(range(32)), 0xFFFFFFFF)
    back = notification_from_proto(notification_to_proto(_note(canary)))
    assert back.canary == canary
    assert notification_from_proto(notification_to_proto(_note(None))).canary is None


def test_too_many_ranges_are_refused() -> None:
    pb = notification_to_proto(_note(Canary(b"\0" * RANGE_BYTES * (MAX_CANARY_RANGES + 1), 1)))
    with pytest.raises(InvalidArgumentError, match="canary_ranges"):
        notification_from_proto(pb)
