"""Bearer-token authentication for every RPC except health, as a server interceptor."""

import hmac
import pathlib

import grpc

from controlplane.interceptors import handler_like

_OPEN_PREFIXES = ("/grpc.health.v1.Health/",)


def read_api_keys(path: pathlib.Path) -> tuple[bytes, ...]:
    """One key per line; blank lines and lines starting with # are ignored."""
    keys = tuple(line.strip().encode() for line in path.read_text().splitlines()
                 if line.strip() and not line.lstrip().startswith("#"))
    if not keys:
        raise ValueError(f"{path} holds no API key")
    return keys


def _is_valid(token: bytes, keys: tuple[bytes, ...]) -> bool:
    """Constant time in the token: every key is compared, whatever matched before."""
    ok = False
    for key in keys:
        ok |= hmac.compare_digest(token, key)
    return ok


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, keys: tuple[bytes, ...]) -> None:
        self.keys = keys

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(_OPEN_PREFIXES):
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        header = metadata.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() == "bearer" and _is_valid(token.strip().encode(), self.keys):
            return handler
        return _refusal(handler, "missing or invalid API key (send 'authorization: Bearer <key>')")


def _refusal(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that fails with UNAUTHENTICATED."""
    async def refuse(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def refuse_stream(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - makes this an async generator

    return handler_like(handler, refuse, refuse_stream)
