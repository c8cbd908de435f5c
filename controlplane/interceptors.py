"""Server interceptors that answer a call before its servicer does, and what they share:
`handler_like` builds a handler of the same kind as the one gRPC found."""

import grpc
from google.protobuf.message import DecodeError


def handler_like(handler: grpc.RpcMethodHandler, unary, stream, request_deserializer=None
                 ) -> grpc.RpcMethodHandler:
    """A handler of `handler`'s kind running `unary` (a coroutine function) for calls with one
    response and `stream` (an async generator function) for streamed ones, with `handler`'s
    serializers unless `request_deserializer` replaces its own."""
    kwargs = dict(request_deserializer=request_deserializer or handler.request_deserializer,
                  response_serializer=handler.response_serializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary, **kwargs)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(stream, **kwargs)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary, **kwargs)
    return grpc.stream_stream_rpc_method_handler(stream, **kwargs)


def malformed(what: str, error: DecodeError) -> str:
    """INVALID_ARGUMENT's details for request bytes that do not parse as `what`."""
    return f"the request is not a valid {what}: {error}"


class _Malformed:
    """What a request whose bytes do not parse deserializes to: the call answers it."""

    def __init__(self, details: str) -> None:
        self.details = details


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """A request to `service` whose bytes do not parse (bad UTF-8 in a string field, a
    truncated message) gets INVALID_ARGUMENT, as the front-ends answer it
    (controlplane/frontend_link.py), where gRPC would answer UNKNOWN with the parser's
    exception class and log a traceback."""

    def __init__(self, service: str) -> None:
        self.prefix = f"/{service}/"  # (its streaming method is an async generator)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None or handler.request_streaming \
                or not handler_call_details.method.startswith(self.prefix):
            return handler
        parse = handler.request_deserializer

        def deserialize(data: bytes):
            try:
                return parse(data)
            except DecodeError as e:
                return _Malformed(malformed(f"request of {handler_call_details.method}", e))

        async def unary(request, context):
            if isinstance(request, _Malformed):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.details)
            return await handler.unary_unary(request, context)

        async def stream(request, context):
            if isinstance(request, _Malformed):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.details)
            async for response in handler.unary_stream(request, context):
                yield response

        return handler_like(handler, unary, stream, deserialize)
