"""Helpers several end-to-end tests share that have no use outside this suite: a PeerService
client of their own (credentials from the cluster's throwaway CA, one GetAgent call), as a rogue
peer or a test that inspects what a producer serves would make one."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import grpc

from kvsidecar.testing.cluster import PREFILL
from kvsidecar.testing.pki import PeerCertificates
from kvsidecar.v1 import peer_pb2, peer_pb2_grpc


def credentials(
    certs: PeerCertificates | None, *, client_cert: bool = True
) -> grpc.ChannelCredentials:
    """TLS credentials trusting ``certs``' CA, presenting its certificate (``client_cert``)."""
    assert certs is not None
    if not client_cert:
        return grpc.ssl_channel_credentials(root_certificates=certs.ca.read_bytes())
    return grpc.ssl_channel_credentials(
        certs.ca.read_bytes(), certs.key.read_bytes(), certs.cert.read_bytes()
    )


async def get_agent(
    endpoint: str, creds: grpc.ChannelCredentials | None
) -> peer_pb2.GetAgentResponse:
    """GetAgent of prefill rank 0 at ``endpoint`` (``creds`` None: an insecure channel)."""
    channel = (
        grpc.aio.insecure_channel(endpoint)
        if creds is None
        else grpc.aio.secure_channel(endpoint, creds)
    )
    async with channel:
        stub = peer_pb2_grpc.PeerServiceStub(channel)
        return await stub.GetAgent(
            peer_pb2.GetAgentRequest(engine_id=PREFILL, tp_rank=0), timeout=5
        )


@contextlib.asynccontextmanager
async def peer_service(
    servicer: peer_pb2_grpc.PeerServiceServicer, certs: PeerCertificates
) -> AsyncIterator[str]:
    """Serve ``servicer`` as a PeerService on loopback with ``certs`` (mutual TLS, as a peer with
    a valid certificate would); yields its ``host:port``, stopped on exit."""
    server = grpc.aio.server()
    peer_pb2_grpc.add_PeerServiceServicer_to_server(servicer, server)
    creds = grpc.ssl_server_credentials(
        [(certs.key.read_bytes(), certs.cert.read_bytes())],
        root_certificates=certs.ca.read_bytes(),
        require_client_auth=True,
    )
    port = server.add_secure_port("127.0.0.1:0", creds)
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(0)
