"""Same-marker ABA (issue 37, item 4): a HOLD of a request with the same token and ids after its
hold ended would publish the same board marker and get the same answers, so a READ made between
the two holds (of blocks the engine may have rewritten) would be confirmed. Every hold instance
must be told apart by what the consumer knows: the ledger refuses a HOLD that reuses the token of
the request's ended hold; with a new token, the marker is another."""

from __future__ import annotations

import pytest

from kvsidecar.engine.holds.ledger import ConsumerId, ProducerLedger
from kvsidecar.errors import AlreadyExistsError
from kvsidecar.plan.hold.board import marker_of

TOKEN, NEW = "t" * 32, "n" * 32
HELD = ((3, 9, 10),)


def _end(ledger: ProducerLedger, rid: str, how: str, now: list[float]) -> None:
    if how == "release":
        assert ledger.release(rid)
    elif how == "expire":
        now[0] += 2.0
        assert [d.request_id for d in ledger.reap()] == [rid]
    else:  # its one consumer read it: SEND_DONE
        _, done = ledger.notify(
            rid, expected_consumers=1, consumer=ConsumerId(engine_id="d", rank=0), token=TOKEN
        )
        assert done is not None


@pytest.mark.parametrize("how", ["release", "expire", "done"])
def test_a_request_held_again_needs_a_new_token(how: str) -> None:
    now = [0.0]
    ledger = ProducerLedger(default_lease_s=1.0, clock=lambda: now[0])
    assert ledger.hold("r", block_ids=HELD, token=TOKEN) is None
    _end(ledger, "r", how, now)
    with pytest.raises(AlreadyExistsError, match="needs a new token"):
        ledger.hold("r", block_ids=HELD, token=TOKEN)
    assert ledger.hold("r", block_ids=HELD, token=NEW) is None  # a new instance, a new token
    assert marker_of(NEW, 1, "r", HELD) != marker_of(TOKEN, 1, "r", HELD)


def test_other_requests_and_live_holds_are_unaffected() -> None:
    ledger = ProducerLedger(default_lease_s=1.0, clock=lambda: 0.0)
    assert ledger.hold("a", block_ids=HELD, token=TOKEN) is None
    assert ledger.hold("b", block_ids=HELD, token=TOKEN) is None  # another request: any token
    with pytest.raises(AlreadyExistsError, match="already held"):
        ledger.hold("a", block_ids=HELD, token=NEW)
