"""Explain: what each sidecar remembers of recent requests, and one request merged from both sides.

``ring``: ``TraceRing``, the bounded record of recent requests (by count and age, ended ones
included) that the hot path appends to: one tuple per state, no per-read object beyond the ring's
entry. The consumer side keeps one ring keyed by its local request ids (and found by the
producer's request id too), the producer side one keyed by its hold's request id. ``explain``:
a request's sides as values, and the merge that asks every producer rank over PeerService
(``Trace``) with a clock offset estimated from the round trip.

May import: the engine's leaves (``model``), ``peers/`` (to reach producer ranks: the registry
and the link) and, outside the engine, ``types``, ``limits``, ``plan`` and ``wire``. Nothing of
``reads/`` or ``holds/``: they record through the ``model.Tracer`` protocol the ring satisfies.
"""
