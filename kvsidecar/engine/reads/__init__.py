"""The consumer side: Reads from remote engines, from the engine's call to its one event.

Owns: accepting Reads, ReadBatches and the notify-only calls (``consumer``); a batch as one value
(``batch``); request ids, the one place that says whether an id may be used (``ids``); in-flight
reads, their transfer handles, polls and deadlines (``inflight``) and the values behind them
(``state``); how reads end, their events and counters (``report``); every notification to a
producer, built, sent and answered (``confirm``); the one lock between using a peer's handles and
releasing them (``guard``).

May import: ``peers/``, ``backend/``, the engine's leaves and ``local``. Never ``holds/``.
"""
