"""The engine process's end of its gRPC front-ends (controlplane/frontend.py): a ZeroMQ ROUTER on
a private ipc:// socket. Each forwarded call runs the GenerationServicer method it names, as a
gRPC server would, with a context whose `abort` ends the call with that status; its responses go
back serialized. Generate runs as the servicer's `open_stream` and a sink on the request's
stream, which writes each response as the engine releases it: no task switch per message.
Everything that one turn of the loop produced for a front-end leaves as one message
(protos/frontend.proto): the engine wakes 16 streams a turn (engine._RELEASE_BATCH), so
a step of 256 streams costs it 16 sends instead of 256 gRPC writes, which run, one per stream,
in the front-end's process on another core.
"""

import asyncio
import logging
import time

import grpc
import zmq
import zmq.asyncio
from google.protobuf.message import DecodeError

from common.transport import unbounded_socket
from controlplane.api_server import GenerationServicer, chunk_replies
from controlplane.grpc_server import SERVICE
from controlplane.interceptors import malformed
from controlplane.streams import Chunk
from protos import frontend_pb2, generation_pb2

log = logging.getLogger("splitserve.frontend")

_STATE_EVERY_S = 1.0
_FRONTEND_SILENT_S = 3.0  # front-ends say Hello every second; silent this long: gone


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class _CallContext:
    """The part of grpc.aio.ServicerContext the servicer uses, for a forwarded call."""

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise _Aborted(code, details)


class FrontendLink:
    """`serving()` is the readiness the front-ends report (pushed with `state_changed`)."""

    def __init__(self, address: str, servicer: GenerationServicer, serving) -> None:
        self.address = address
        self.serving = serving
        self._servicer = servicer
        self.on_hello = lambda port: None  # a front-end serves gRPC on `port`
        # method name -> (handler, request type, streams responses)
        self._methods = {m.name: (getattr(servicer, m.name),
                                  getattr(generation_pb2, m.input_type.name), m.server_streaming)
                         for m in SERVICE.methods}
        self._sock: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []
        self._calls: dict[tuple[bytes, int], asyncio.Task] = {}
        self._frontends: dict[bytes, float] = {}  # identity -> when last heard
        self._out: dict[bytes, dict[int, frontend_pb2.Reply]] = {}
        self._state_due = False
        self._flush_scheduled = False
        self.num_dropped = 0  # malformed messages

    async def start(self) -> None:
        # A front-end silent for _FRONTEND_SILENT_S is forgotten, which bounds its queue.
        self._sock = unbounded_socket(zmq.ROUTER)
        self._sock.bind(self.address)
        self._tasks = [asyncio.create_task(self._reader(), name="frontend-reader"),
                       asyncio.create_task(self._ticker(), name="frontend-state")]

    async def close(self) -> None:
        self._flush_scheduled = True  # nothing is sent any more
        for task in [*self._tasks, *self._calls.values()]:
            task.cancel()
        await asyncio.gather(*self._tasks, *self._calls.values(), return_exceptions=True)
        if self._sock is not None:
            self._sock.close(linger=0)

    def state_changed(self) -> None:
        self._state_due = True
        self._schedule_flush()

    # -- calls ---------------------------------------------------------------------------------

    async def _reader(self) -> None:
        while True:
            # One message a turn of the loop: a message already waiting is returned without
            # yielding, so a burst of calls (workload A sends 256 at once) would otherwise start
            # them all in one turn and hold the engine's next step behind their admission, with
            # the device idle (~60 ms of the split's prompt steps on the H200). Sixteen a turn
            # (2afef27, reader_calls_per_turn-2afef27.json) gave fuller first prompt steps but
            # as much more idle before them: no faster.
            await asyncio.sleep(0)
            frames = await self._sock.recv_multipart()
            try:
                identity, payload = frames
                message = frontend_pb2.ToEngine.FromString(payload)
            except (ValueError, DecodeError):  # not from a front-end of ours: ignored, not fatal
                self.num_dropped += 1
                log.warning("dropped a malformed message on the front-end socket (%d frames)",
                            len(frames))
                continue
            body = message.WhichOneof("body")
            if identity in self._frontends:
                self._frontends[identity] = time.monotonic()
            if body == "call":
                key = (identity, message.call.call_id)
                task = self._calls[key] = asyncio.create_task(self._run(identity, message.call))
                # (a task cancelled before it first ran never enters _run's finally)
                task.add_done_callback(lambda done, key=key: self._forget_call(key, done))
            elif body == "cancel":
                task = self._calls.get((identity, message.cancel.call_id))
                if task is not None:
                    task.cancel()
            elif body == "hello" and identity not in self._frontends:
                # (the front-end's own INFO line says so, also when a restarted one serves)
                log.debug("a gRPC front-end serves on port %d", message.hello.port)
                self._frontends[identity] = time.monotonic()
                self.state_changed()
                self.on_hello(message.hello.port)

    async def _run(self, identity: bytes, call: frontend_pb2.Call) -> None:
        try:
            handler, request_type, streams = self._methods[call.method]
            try:
                request = request_type.FromString(call.request)
            except DecodeError as e:  # the client's bytes (bad UTF-8 in a string field, ...)
                raise _Aborted(grpc.StatusCode.INVALID_ARGUMENT,
                               malformed(request_type.DESCRIPTOR.full_name, e)) from None
            if streams:  # Generate, the one streaming method (controlplane/frontend.py)
                await self._generate(identity, call.call_id, request)
            else:
                response = await handler(request, _CallContext())
                self._reply(identity, call.call_id, response.SerializeToString())
            self._reply(identity, call.call_id, done=(grpc.StatusCode.OK, ""))
        except _Aborted as e:
            self._reply(identity, call.call_id, done=(e.code, e.details))
        except asyncio.CancelledError:
            pass  # the client went away: nobody to answer
        except Exception:
            log.exception("call %s failed", call.method)
            self._reply(identity, call.call_id, done=(grpc.StatusCode.INTERNAL,
                                                      f"{call.method} failed in the server"))

    async def _generate(self, identity: bytes, call_id: int,
                        request: generation_pb2.GenerateRequest) -> None:
        """Generate, its responses written by a sink on the request's stream as the engine
        releases it (controlplane/streams.py), not by this task woken for each. Returns when
        the request ended well; raises _Aborted with its status when it failed."""
        request_id, stream = await self._servicer.open_stream(request, _CallContext())
        ended: asyncio.Future[tuple[grpc.StatusCode, str] | None] = \
            asyncio.get_running_loop().create_future()

        def deliver(chunk: Chunk) -> None:
            if ended.done():
                return
            try:
                response, error = chunk_replies(request_id, chunk)
                if response is not None:
                    self._reply(identity, call_id, response.SerializeToString())
                if chunk.finish_reason is not None:
                    ended.set_result(error)
            except Exception as e:  # (raised here, it would fail the engine's loop)
                ended.set_exception(e)

        stream.push_to(deliver)
        finished = False
        try:
            error = await ended
            finished = True
        finally:
            if not finished:  # the client went away, or the sink failed
                stream.push_to(None)
                self._servicer.close_stream(request_id, stream)
        if error is not None:
            raise _Aborted(*error)

    def _forget_call(self, key: tuple[bytes, int], task: asyncio.Task) -> None:
        if self._calls.get(key) is task:
            del self._calls[key]

    # -- replies -------------------------------------------------------------------------------

    def _reply(self, identity: bytes, call_id: int, message: bytes | None = None,
               done: tuple[grpc.StatusCode, str] | None = None) -> None:
        replies = self._out.setdefault(identity, {})
        reply = replies.get(call_id)
        if reply is None:
            reply = replies[call_id] = frontend_pb2.Reply(call_id=call_id)
        if message is not None:
            reply.messages.append(message)
        if done is not None:
            reply.done, reply.status_code, reply.details = True, done[0].value[0], done[1]
        self._schedule_flush()

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        """Send what this turn of the loop produced: one message per front-end."""
        self._flush_scheduled = False
        out, self._out = self._out, {}
        state = frontend_pb2.State(serving=self.serving()) if self._state_due else None
        self._state_due = False
        for identity in (self._frontends.keys() | out.keys()) if state is not None else out.keys():
            message = frontend_pb2.ToFrontend(replies=out.get(identity, {}).values())
            if state is not None:
                message.state.CopyFrom(state)
            # (sent at once: no high-water mark; not awaited: a turn of the loop never waits
            # for a front-end)
            sent = self._sock.send_multipart([identity, message.SerializeToString()])
            sent.add_done_callback(_log_failure)

    async def _ticker(self) -> None:
        woke = time.monotonic()
        while True:
            await asyncio.sleep(_STATE_EVERY_S)
            late, woke = time.monotonic() - woke > 2 * _STATE_EVERY_S, time.monotonic()
            self.state_changed()
            if not late:  # after a stall of this loop, Hellos may still wait unread
                self._forget_silent(woke - _FRONTEND_SILENT_S)

    def _forget_silent(self, heard_before: float) -> None:
        """A front-end that died or hung: its calls end (their requests are aborted, their KV
        blocks freed), as if each client had cancelled."""
        for identity in [i for i, heard in self._frontends.items() if heard < heard_before]:
            del self._frontends[identity]
            calls = [(call_id, task) for (owner, call_id), task in self._calls.items()
                     if owner == identity]
            log.warning("a gRPC front-end went silent; ending its %d calls", len(calls))
            for call_id, task in calls:
                task.cancel()
                # (should it come back, its clients hear why)
                self._reply(identity, call_id, done=(grpc.StatusCode.UNAVAILABLE,
                                                     "the server's gRPC front-end stalled"))


def _log_failure(sent: asyncio.Future) -> None:
    if not sent.cancelled() and sent.exception() is not None:
        log.warning("a reply to a front-end was not sent: %s", sent.exception())
