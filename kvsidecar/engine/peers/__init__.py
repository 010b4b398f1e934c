"""Remote engines: who they are, how to reach them, and the handshake that makes them peers.

Owns: the ``PeerRegistry`` of handshaken remote engines with their NIXL handles, handshakes in
progress and backoff (``registry``); the gRPC client of other sidecars' PeerService — agent
metadata, engine directories, the NotifyStream channels (``link``); running one shared handshake
per remote engine (``handshake``) through its two steps, the network fetch and the backend attach
(``phases``); agent proofs, which keep a peer from claiming another sidecar's NIXL agent
(``proof``); the cost matrix of live remote engine ranks, fed by the read side (``costs``, owned
by the link) and its optional idle probe (``probe``).

May import: ``backend/``, the engine's leaves and ``local``. Never ``reads/`` or ``holds/``: what
a handshake must do to the read side (quarantine a stale peer) arrives as a callback.
"""
