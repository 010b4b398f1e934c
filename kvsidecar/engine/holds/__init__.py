"""The producer side: holds on blocks until their consumers have read them.

Owns: the pure ledger of holds, leases and consumer counts (``ledger``) with its deadline heap
(``deadlines``), and the daemon's wrapper around it — tokens, the outcome of every consumer
notification, SEND_DONE events and counters (``producer``).

May import: the engine's leaves only. Never ``reads/``, ``peers/`` or ``backend/``: a producer
answers notifications; it moves no bytes and knows no peer.
"""
