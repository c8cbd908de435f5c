"""A gRPC front-end process of the control plane: it owns the client connections (TLS, API keys,
health, reflection) and forwards every Generation RPC, as bytes, to the engine process over
ZeroMQ (controlplane/frontend_link.py), streaming back what the engine answers.

Why a process of its own: a gRPC message costs tens of microseconds of CPU to write (a system
call per message among it), and with hundreds of streams one message per token per stream was
most of the engine loop's time per step, on the loop that must also schedule the next step.
Here those writes run on another core, and the engine sends one message per turn of its loop.
vLLM (API server / engine core) and SGLang (tokenizer and detokenizer managers) split the same
way.

Health: readiness ("" and the Generation service) is what the engine last reported; liveness
("liveness") is SERVING while the engine process is heard from (it reports every second). An
engine silent for _ENGINE_GONE_S is hung: the calls in flight end UNAVAILABLE (their requests are
cancelled, for when it wakes) and new ones are turned away until it is heard again, so no client
waits forever on it.
"""

import asyncio
import itertools
import logging
import signal
import time
from dataclasses import dataclass

import grpc
import zmq
import zmq.asyncio
from grpc_health.v1 import health

from common.transport import unbounded_socket
from controlplane.grpc_server import SERVICE, GrpcServerConfig, set_health, start_server
from protos import frontend_pb2, generation_pb2

log = logging.getLogger("splitserve.frontend")

_ENGINE_SILENT_S = 5.0  # the engine reports every second; silent this long: not live
_ENGINE_GONE_S = 10.0  # silent this long: hung, its calls end UNAVAILABLE
_MESSAGES_PER_TURN = 16  # the reader yields to the RPC handlers after this many


@dataclass(frozen=True)
class FrontendConfig:
    engine_address: str  # the engine process's ROUTER (ipc://)
    grpc: GrpcServerConfig


class Frontend:
    def __init__(self, config: FrontendConfig) -> None:
        self.config = config
        self.health = health.HealthServicer(experimental_non_blocking=True)
        self.server: grpc.aio.Server | None = None
        self.port: int | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._ids = itertools.count(1)
        self._calls: dict[int, asyncio.Queue] = {}
        self._abandoned: set[int] = set()  # calls ended here, the engine silent
        self._last_heard = 0.0
        self._health: tuple[bool, bool] | None = None  # (serving, live) as last set
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> int:
        self._set_health(serving=False, live=False)
        self._last_heard = time.monotonic()  # (the engine's first word takes up to a second)
        self._sock = unbounded_socket(zmq.DEALER)
        self._sock.connect(self.config.engine_address)
        self.server, self.port = await start_server(
            lambda server: server.add_generic_rpc_handlers((self._generation_handler(),)),
            self.health, self.config.grpc)
        self._tasks = [asyncio.create_task(self._reader(), name="engine-reader"),
                       asyncio.create_task(self._keep_in_touch(), name="engine-watch")]
        log.info("front-end serving gRPC on %s:%d", self.config.grpc.host, self.port)
        return self.port

    async def stop(self, grace_s: float = 1.0) -> None:
        if self.server is not None:
            await self.server.stop(grace_s)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._sock.close(linger=0)

    # -- RPCs ----------------------------------------------------------------------------------

    def _generation_handler(self) -> grpc.GenericRpcHandler:
        """Every Generation method, with requests and responses left serialized."""
        handlers = {}
        for method in SERVICE.methods:
            if method.server_streaming:
                handlers[method.name] = grpc.unary_stream_rpc_method_handler(
                    self._streaming(method.name))
            else:
                handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                    self._unary(method.name))
        return grpc.method_handlers_generic_handler(SERVICE.full_name, handlers)

    def _streaming(self, name: str):
        assert name == "Generate", "responses are merged as GenerateResponses"

        async def handle(request: bytes, context: grpc.aio.ServicerContext):
            async for responses in self._forward(name, request, context):
                yield _merged(responses)
        return handle

    def _unary(self, name: str):
        async def handle(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            [response] = [r async for rs in self._forward(name, request, context) for r in rs]
            if name == "GetLoad":  # add this process's CPU time
                load = generation_pb2.Load.FromString(response)
                load.frontend_cpu_seconds = time.process_time()
                response = load.SerializeToString()
            return response
        return handle

    async def _forward(self, name: str, request: bytes, context: grpc.aio.ServicerContext):
        """The call's serialized responses, in lists of what arrived while the last list was
        being written; its status at the end."""
        if self._engine_gone():
            await context.abort(grpc.StatusCode.UNAVAILABLE, _GONE)
        call_id = next(self._ids)
        replies: asyncio.Queue[frontend_pb2.Reply] = asyncio.Queue()
        self._calls[call_id] = replies
        ended = False
        try:
            await self._send(frontend_pb2.ToEngine(call=frontend_pb2.Call(
                call_id=call_id, method=name, request=request)))
            while not ended:
                reply = await replies.get()
                responses = list(reply.messages)
                while not reply.done and not replies.empty():
                    reply = replies.get_nowait()
                    responses.extend(reply.messages)
                ended = reply.done
                if responses:
                    yield responses
            if reply.status_code != grpc.StatusCode.OK.value[0]:
                await context.abort(_STATUS[reply.status_code], reply.details)
        finally:
            del self._calls[call_id]
            if not ended or call_id in self._abandoned:  # the client went away, or we did
                self._abandoned.discard(call_id)
                await self._send(frontend_pb2.ToEngine(cancel=frontend_pb2.Cancel(call_id=call_id)))

    async def _send(self, message: frontend_pb2.ToEngine) -> None:
        await self._sock.send(message.SerializeToString())

    # -- the engine ----------------------------------------------------------------------------

    async def _reader(self) -> None:
        """Hands each reply to its call's queue. Awaiting a message that is already queued does
        not suspend, so after a backlog the reader yields every _MESSAGES_PER_TURN messages:
        the handlers that write the replies to the clients run in between."""
        for count in itertools.count(1):
            if count % _MESSAGES_PER_TURN == 0:
                await asyncio.sleep(0)
            message = frontend_pb2.ToFrontend.FromString(await self._sock.recv())
            for reply in message.replies:
                replies = self._calls.get(reply.call_id)
                if replies is not None:
                    replies.put_nowait(reply)
            if message.HasField("state"):
                self._last_heard = time.monotonic()
                self._set_health(serving=message.state.serving, live=True)

    def _set_health(self, serving: bool, live: bool) -> None:
        """Only a change is set: every set sends a message to every Health.Watch client."""
        if (serving, live) != self._health:
            self._health = (serving, live)
            set_health(self.health, serving=serving, live=live)

    async def _keep_in_touch(self) -> None:
        """Hello every second (the engine's sign of this front-end's life); not live while the
        engine is silent."""
        hello = frontend_pb2.ToEngine(hello=frontend_pb2.Hello(port=self.port))
        while True:
            await self._send(hello)
            await asyncio.sleep(1.0)
            if self._engine_silent_for() > _ENGINE_SILENT_S:
                self._set_health(serving=False, live=False)
            if self._engine_gone():
                self._abandon_calls()

    def _engine_silent_for(self) -> float:
        return time.monotonic() - self._last_heard

    def _engine_gone(self) -> bool:
        return self._engine_silent_for() > _ENGINE_GONE_S

    def _abandon_calls(self) -> None:
        for call_id, replies in self._calls.items():
            if call_id not in self._abandoned:
                self._abandoned.add(call_id)
                replies.put_nowait(frontend_pb2.Reply(
                    call_id=call_id, done=True, status_code=grpc.StatusCode.UNAVAILABLE.value[0],
                    details=_GONE))


_STATUS = {code.value[0]: code for code in grpc.StatusCode}
_GONE = f"the server's engine process has not answered for {_ENGINE_GONE_S:.0f}s"


def _merged(responses: list[bytes]) -> bytes:
    """Generate responses that piled up for one stream while its last message was being
    written, as one (as the engine's streams do for a reader that lags): their tokens, texts and
    logprobs in order, the last one's finish reason and usage."""
    if len(responses) == 1:
        return responses[0]
    merged = generation_pb2.GenerateResponse()
    texts = []
    for response in responses:
        part = generation_pb2.GenerateResponse.FromString(response)
        texts.append(part.text)
        merged.MergeFrom(part)
    merged.text = "".join(texts)
    return merged.SerializeToString()


async def run_frontend(config: FrontendConfig) -> None:
    """Serve until SIGTERM: the engine process stops its front-ends after draining, so SIGINT
    (a Ctrl-C reaches the whole process group) is left to it."""
    frontend = Frontend(config)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, lambda: None)
    await frontend.start()
    await stop.wait()
    await frontend.stop()
