"""The producer side: holds on blocks until their consumers have read them.

Owns: the pure ledger of holds, leases and consumer counts (``ledger``) with its deadline heap
(``deadlines``) and its values (``entries``), and the daemon's wrapper around it — tokens, the
outcome of every consumer notification, SEND_DONE events and counters (``producer``); the hold
board, every live hold's marker in the sidecar's own registered memory (``board``: written here,
laid out by ``plan.hold.board``, read by consumers' board checks); the producer's half of the
integrity canary, the CRC of held bytes a consumer names (``canary``).

May import: the engine's leaves only. Never ``reads/``, ``peers/`` or ``backend/``: a producer
answers notifications; it moves no bytes and knows no peer.
"""
