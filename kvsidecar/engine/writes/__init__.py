"""Push mode (DESIGN §5c, docs/push.md): the consumer's write grants and the producer's WRITEs.

``grants`` is the consumer's pure state (grants, what their writers covered, each grant's single
end); ``granter`` issues grants, answers writers (GetGrant, WriteNotify), watches them
(WatchWriter) and revokes; ``pusher`` is the producer's side (GetGrant, WRITEs, CHUNK_DONE,
RevokeGrant, the beats), with ``targets`` (each consumer rank's agent and lists, prepared once
per epoch, as a Read's peer is) and ``tokens`` (WRITEs in flight and revocations per grant
token); ``calls`` the PeerService calls both make; ``face`` what the servicers call. Both sides
plan with ``rows``: the consumer's pull plan, the other way.

May import: ``peers/`` (the link, the registry, handshake phases), ``backend/``, ``local`` and the
engine's leaves; never ``reads/`` or ``holds/`` (push mode shares the event hub and the peer link
with them, not their state).
"""
