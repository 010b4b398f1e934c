"""Method handlers that decode requests themselves, so that undecodable bytes are the caller's
error (INVALID_ARGUMENT, one log line at debug) instead of gRPC's UNKNOWN with a traceback.

``service_handler(servicer, module, name)`` replaces the generated ``add_*Servicer_to_server``: it
registers every method of the service with a raw-bytes deserializer and parses the message inside
the handler.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf import descriptor, message, message_factory

log = logging.getLogger(__name__)


def _parse(cls: type[message.Message], raw: bytes, context: Any) -> message.Message | None:
    """The request, or ``None`` with the call's status set to INVALID_ARGUMENT. No abort is raised:
    a raised abort keeps the frames holding ``raw`` alive (see ``rpc.status``)."""
    request = cls()
    try:
        request.ParseFromString(raw)
    except message.DecodeError as exc:
        log.debug("undecodable %s: %s", cls.__name__, exc)
        context.set_code(grpc.StatusCode.INVALID_ARGUMENT)
        context.set_details(f"request is not a valid {cls.__name__}: {exc}")
        return None
    return request


def _unary(impl: Callable[..., Awaitable[Any]], cls: type[message.Message]) -> Any:
    async def handle(raw: bytes, context: Any) -> Any:
        request = _parse(cls, raw, context)
        del raw
        return None if request is None else await impl(request, context)

    return handle


def _stream(impl: Callable[..., AsyncIterator[Any]], cls: type[message.Message]) -> Any:
    async def handle(raw: bytes, context: Any) -> AsyncIterator[Any]:
        request = _parse(cls, raw, context)
        del raw
        if request is None:
            return
        async for item in impl(request, context):
            yield item

    return handle


def _bidi(impl: Callable[..., AsyncIterator[Any]], cls: type[message.Message]) -> Any:
    async def handle(raws: AsyncIterator[bytes], context: Any) -> AsyncIterator[Any]:
        async def requests() -> AsyncIterator[message.Message]:
            async for raw in raws:
                request = _parse(cls, raw, context)
                if request is None:  # the status is set: end the stream with it
                    return
                yield request

        async for item in impl(requests(), context):
            yield item

    return handle


def service_handler(servicer: Any, module: Any, name: str) -> grpc.GenericRpcHandler:
    """Every (unary, server-streaming or bidirectional) method of service ``name`` of the
    generated ``module`` (``engine_pb2``, ``peer_pb2``), served by ``servicer``."""
    service: descriptor.ServiceDescriptor = module.DESCRIPTOR.services_by_name[name]
    handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}
    for method in service.methods:
        request_cls = message_factory.GetMessageClass(method.input_type)
        serialize = message_factory.GetMessageClass(method.output_type).SerializeToString
        impl = getattr(servicer, method.name)
        if method.client_streaming and method.server_streaming:
            handlers[method.name] = grpc.stream_stream_rpc_method_handler(
                _bidi(impl, request_cls), response_serializer=serialize
            )
        elif method.client_streaming:
            raise TypeError(f"{method.full_name}: client-only streaming is not supported")
        elif method.server_streaming:
            handlers[method.name] = grpc.unary_stream_rpc_method_handler(
                _stream(impl, request_cls), response_serializer=serialize
            )
        else:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                _unary(impl, request_cls), response_serializer=serialize
            )
    return grpc.method_handlers_generic_handler(service.full_name, handlers)
