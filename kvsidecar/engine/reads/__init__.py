"""The consumer side: Reads from remote engines, from the engine's call to its one event.

Owns: accepting Reads, ReadBatches and the notify-only calls (``consumer``); a batch as one value
(``batch``); request ids, the one place that says whether an id may be used (``ids``); the reads
of a registration and how each ends, with exactly one event (``book``), their events and counters
(``report``) and the values behind them (``state``); posting the READs of reads that go together,
one per producer rank (``post``), and the transfer handles they share, each released once
(``transfers``); where a staging producer's hold sits in its pool, found before its READs
(``locate``); in-flight reads, composing the book and the confirmation: posts, completions,
polls and deadlines (``inflight``); confirmation, from READs done to the end (``confirm/``); the
one lock between using a peer's handles and releasing them (``guard``).

May import: ``peers/``, ``backend/``, the engine's leaves and ``local``. Never ``holds/``.
"""
