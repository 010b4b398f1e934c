"""Confirmation: a read's bytes count only once every producer rank read from vouched that the
read's hold was live, under its token and epoch, after the READs (docs/confirmation.md).

Owns: the flow from READs done to the read's end, the one place an answer ends a read (``flow``:
``Confirmation``); checking producers' hold boards with one small READ per rank into landing
slots (``checks``); every notification to a producer, built, sent in one message per rank and
turn of the loop, and answered (``send``: ``Confirmer``, READ_DONE, CONSUMED, HEARTBEAT); the
consumer's half of the integrity canary (``canary``).

May import: what ``reads/`` may (``peers/``, ``backend/``, the engine's leaves, ``local``) and the
read side's values and book (``reads.state``, ``reads.book``). Never ``holds/``: the producer's
board is known here only by its layout (``plan.hold.board``).
"""
