"""The front-end link: replies to a front-end that is not reading queue without loss; a burst of
calls does not hold the engine's next step back; the front-end's merging of Generate responses
that piled up for one stream."""

import asyncio
import contextlib
import time
import types

import grpc
import pytest
import zmq
import zmq.asyncio

from common.model_info import ModelInfo
from common.transport import private_ipc_address
from controlplane.api_server import GenerationServicer
from controlplane.engine import Engine, EngineConfig
from controlplane.frontend import _merged
from controlplane import frontend_link
from controlplane.frontend_link import SERVICE, FrontendLink
from controlplane.scheduler import SchedulerConfig
from controlplane.tokenizer import Tokenizer
from dataplane.checkpoints import build_tokenizer
from protos import frontend_pb2
from protos import generation_pb2 as pb
from tests.controlplane.fake_dataplane import FakeDataPlane

pytestmark = pytest.mark.timeout(60)


def test_messages_to_a_frontend_that_does_not_read_queue_without_loss():
    """3000 messages while the front-end reads nothing, then all of them. The front-end's
    socket here has ZeroMQ's default receive high-water mark (1000; controlplane/frontend.py
    sets none): with the default send mark on the link's side too, a third would be dropped
    without an error."""
    async def main():
        servicer = types.SimpleNamespace(**{m.name: None for m in SERVICE.methods})
        link = FrontendLink(private_ipc_address("frontend"), servicer, serving=lambda: True)
        hello = asyncio.Event()
        link.on_hello = lambda port: hello.set()
        await link.start()
        frontend = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        frontend.setsockopt(zmq.RCVHWM, 1000)  # ZeroMQ's default (frontend.py sets none)
        frontend.setsockopt(zmq.LINGER, 0)
        frontend.connect(link.address)
        await frontend.send(frontend_pb2.ToEngine(hello=frontend_pb2.Hello(port=1))
                            .SerializeToString())
        await asyncio.wait_for(hello.wait(), 10)
        for _ in range(3000):
            link.state_changed()
            await asyncio.sleep(0)  # one message per turn of the loop
        received = 0
        while received < 3001:  # the answer to Hello and the 3000
            try:
                await asyncio.wait_for(frontend.recv(), 2)
            except TimeoutError:
                break
            received += 1
        frontend.close()
        await link.close()
        return received

    assert asyncio.run(main()) == 3001


def test_calls_cancelled_before_they_start_are_forgotten():
    """A client gone (its deadline passed) while the engine was busy: its call and the cancel
    arrive back to back. Whether the call's task ran before the cancel was read or is cancelled
    before it first runs (it then never enters _run's finally), it must leave the link's table
    of calls."""
    async def open_stream(request, context):  # (Generate's start, as the link calls it)
        await asyncio.sleep(60)

    async def get_load(request, context):
        return pb.Load(num_running=7)

    def call(call_id: int, method: str, request) -> bytes:
        return frontend_pb2.ToEngine(call=frontend_pb2.Call(
            call_id=call_id, method=method, request=request.SerializeToString())).SerializeToString()

    async def main():
        servicer = types.SimpleNamespace(**{m.name: None for m in SERVICE.methods})
        servicer.open_stream, servicer.GetLoad = open_stream, get_load
        link = FrontendLink(private_ipc_address("frontend"), servicer, serving=lambda: True)
        await link.start()
        frontend = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        frontend.setsockopt(zmq.LINGER, 0)
        frontend.connect(link.address)
        for call_id in range(1, 101):
            await frontend.send(call(call_id, "Generate", pb.GenerateRequest()))
            await frontend.send(frontend_pb2.ToEngine(cancel=frontend_pb2.Cancel(
                call_id=call_id)).SerializeToString())
        await frontend.send(call(101, "GetLoad", pb.GetLoadRequest()))
        while True:  # until the last call's answer: the link has read everything before it
            message = frontend_pb2.ToFrontend.FromString(await asyncio.wait_for(frontend.recv(), 10))
            if any(r.call_id == 101 and r.done for r in message.replies):
                break
        await asyncio.sleep(0)
        left = len(link._calls)
        frontend.close()
        await link.close()
        return left

    assert asyncio.run(main()) == 0


def test_a_burst_of_calls_does_not_hold_the_first_step_behind_all_their_admissions():
    """40 Generate calls wait on the link's socket at once. The link takes one a turn of the
    loop, so the engine's first step goes out after the first admissions, not after all 40
    (taking them all in one turn left the H200 idle ~60 ms before split mode's prompt steps)."""
    class Recording(FakeDataPlane):
        engine: Engine
        admitted_at_first_step: int | None = None

        async def execute(self, step, epoch, timeout_s):
            if self.admitted_at_first_step is None:
                self.admitted_at_first_step = len(self.engine.streams)
            return await super().execute(step, epoch, timeout_s)

    async def main():
        dataplane = Recording(num_kv_blocks=256)
        async with engine_behind_a_link(dataplane) as (engine, frontend):
            dataplane.engine = engine
            for call_id in range(40):
                await frontend.send(generate_call(call_id, [1, 2, 3, call_id + 4]))
            time.sleep(0.2)  # (blocking: the loop reads nothing while ZeroMQ delivers the burst)
            await replies_until_done(frontend, 40)
        return dataplane.admitted_at_first_step

    assert 1 <= asyncio.run(main()) < 40


def test_a_generate_call_whose_responses_fail_ends_internal_and_the_rest_are_served(monkeypatch):
    """The link writes Generate's responses from a sink on the engine's stack: a failure there
    ends that call INTERNAL and aborts its request (its blocks freed), and neither the engine's
    loop nor the other calls notice."""
    real = frontend_link.chunk_replies

    def failing(request_id, chunk):
        if request_id == "bad" and chunk.token_ids:
            raise RuntimeError("cannot write this response")
        return real(request_id, chunk)
    monkeypatch.setattr(frontend_link, "chunk_replies", failing)

    async def main():
        async with engine_behind_a_link(FakeDataPlane(num_kv_blocks=256)) as (engine, frontend):
            for call_id, request_id in enumerate(["good-1", "bad", "good-2"]):
                await frontend.send(generate_call(call_id, [1, 2, 3, call_id + 4], request_id,
                                                  max_tokens=8))
            replies = await replies_until_done(frontend, 3)
            while engine.streams:  # (the abort runs once the call's task has its failure)
                await asyncio.sleep(0.01)
            return replies, engine.load()

    replies, load = asyncio.run(main())
    ends = {r.call_id: r.status_code for r in replies if r.done}
    tokens = {call_id: sum(len(pb.GenerateResponse.FromString(m).token_ids)
                           for r in replies if r.call_id == call_id for m in r.messages)
              for call_id in range(3)}
    assert ends == {0: grpc.StatusCode.OK.value[0], 1: grpc.StatusCode.INTERNAL.value[0],
                    2: grpc.StatusCode.OK.value[0]}
    assert tokens[0] == tokens[2] == 8 and tokens[1] == 0
    assert load[:3] == (0, 0, 0)  # nothing running or waiting, no KV block held


def test_a_call_that_went_away_aborts_its_own_request_only():
    """A Generate call that ends early aborts its request by id only while the id is still
    its stream's: a new call may have taken a client-chosen id since (after an Abort RPC)."""
    async def main():
        async with engine_behind_a_link(FakeDataPlane(num_kv_blocks=256)) as (engine, _):
            model = ModelInfo("m", "none", "Qwen3ForCausalLM", 320, 64, (), "float32")
            servicer = GenerationServicer(engine, model, 64, 64, 20)
            request = pb.GenerateRequest(request_id="r", token_ids=pb.TokenIds(ids=[1, 2, 3]),
                                         sampling=pb.SamplingParams(max_tokens=50))
            _, old = await servicer.open_stream(request, frontend_link._CallContext())
            engine.abort("r")
            _, new = await servicer.open_stream(request, frontend_link._CallContext())
            servicer.close_stream("r", old)  # the first call's cleanup, late
            kept = engine.streams.get("r") is new
            servicer.close_stream("r", new)
            return kept, "r" in engine.streams

    assert asyncio.run(main()) == (True, False)


@contextlib.asynccontextmanager
async def engine_behind_a_link(dataplane: FakeDataPlane):
    """A running engine on `dataplane`, a FrontendLink serving its GenerationServicer, and a
    front-end's socket connected to it; all closed on exit."""
    dataplane.connect()
    engine = Engine(EngineConfig(SchedulerConfig(max_num_seqs=64, max_model_len=64)),
                    Tokenizer(build_tokenizer(320), 320), dataplane)
    task = asyncio.create_task(engine.run())
    while not engine.accepting:
        await asyncio.sleep(0)
    model = ModelInfo("m", "none", "Qwen3ForCausalLM", 320, 64, (), "float32")
    link = FrontendLink(private_ipc_address("frontend"),
                        GenerationServicer(engine, model, 64, 64, 20), serving=lambda: True)
    await link.start()
    frontend = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    frontend.setsockopt(zmq.LINGER, 0)
    frontend.connect(link.address)
    try:
        yield engine, frontend
    finally:
        frontend.close()
        await link.close()
        engine.close()
        await task


def generate_call(call_id: int, token_ids: list[int], request_id: str = "",
                  max_tokens: int = 2) -> bytes:
    return frontend_pb2.ToEngine(call=frontend_pb2.Call(
        call_id=call_id, method="Generate", request=pb.GenerateRequest(
            request_id=request_id, token_ids=pb.TokenIds(ids=token_ids),
            sampling=pb.SamplingParams(max_tokens=max_tokens)).SerializeToString())
    ).SerializeToString()


async def replies_until_done(frontend: zmq.asyncio.Socket, num_calls: int
                             ) -> list[frontend_pb2.Reply]:
    """Every reply the front-end's socket gets until `num_calls` calls ended."""
    replies = []
    while sum(r.done for r in replies) < num_calls:
        message = frontend_pb2.ToFrontend.FromString(await asyncio.wait_for(frontend.recv(), 10))
        replies.extend(message.replies)
    return replies


def test_a_malformed_message_is_dropped_and_the_link_serves_on():
    """Garbage on the engine's front-end socket (one frame too many, bytes that are no proto)
    is counted and dropped; it killed the reader, after which every call went unanswered."""
    async def get_load(request, context):
        return pb.Load(num_running=7)

    async def main():
        servicer = types.SimpleNamespace(**{m.name: None for m in SERVICE.methods})
        servicer.GetLoad = get_load
        link = FrontendLink(private_ipc_address("frontend"), servicer, serving=lambda: True)
        await link.start()
        frontend = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        frontend.setsockopt(zmq.LINGER, 0)
        frontend.connect(link.address)
        await frontend.send_multipart([b"two", b"frames"])
        await frontend.send(b"\xff\xff not a proto")
        await frontend.send(frontend_pb2.ToEngine(call=frontend_pb2.Call(
            call_id=1, method="GetLoad",
            request=pb.GetLoadRequest().SerializeToString())).SerializeToString())
        reply = None
        while reply is None:
            message = frontend_pb2.ToFrontend.FromString(await asyncio.wait_for(frontend.recv(), 10))
            reply = next((r for r in message.replies if r.call_id == 1 and r.done), None)
        dropped = link.num_dropped
        frontend.close()
        await link.close()
        return pb.Load.FromString(reply.messages[0]).num_running, dropped

    assert asyncio.run(main()) == (7, 2)


def test_piled_up_responses_merge_into_one_in_order_with_the_last_ones_end():
    parts = [pb.GenerateResponse(request_id="r", token_ids=[1, 2], text="ab",
                                 logprobs=[pb.TokenLogprobs(logprob=-1.0),
                                           pb.TokenLogprobs(logprob=-2.0)]),
             pb.GenerateResponse(request_id="r", token_ids=[3], text="",
                                 logprobs=[pb.TokenLogprobs(logprob=-3.0)]),
             pb.GenerateResponse(request_id="r", token_ids=[4], text="c",
                                 logprobs=[pb.TokenLogprobs(logprob=-4.0)],
                                 finish_reason=pb.FINISH_REASON_LENGTH,
                                 usage=pb.Usage(prompt_tokens=5, completion_tokens=4))]
    merged = pb.GenerateResponse.FromString(_merged([p.SerializeToString() for p in parts]))
    assert merged.request_id == "r" and list(merged.token_ids) == [1, 2, 3, 4]
    assert merged.text == "abc"
    assert [lp.logprob for lp in merged.logprobs] == [-1.0, -2.0, -3.0, -4.0]
    assert merged.finish_reason == pb.FINISH_REASON_LENGTH
    assert (merged.usage.prompt_tokens, merged.usage.completion_tokens) == (5, 4)
    one = parts[0].SerializeToString()
    assert _merged([one]) is one


def test_the_reader_lets_the_handlers_run_while_it_drains_a_backlog():
    """500 replies already queued: receiving each completes at once (awaiting it does not
    suspend), so a reader that never yields would hand out all 500 before any stream's handler
    wrote one to its client."""
    from controlplane.frontend import Frontend

    async def main():
        frontend = Frontend(types.SimpleNamespace())
        backlog = [frontend_pb2.ToFrontend(replies=[frontend_pb2.Reply(call_id=1)])
                   .SerializeToString() for _ in range(500)]

        async def recv():
            if backlog:
                return backlog.pop()
            await asyncio.Event().wait()  # then nothing more comes
        frontend._sock = types.SimpleNamespace(recv=recv)
        replies = frontend._calls[1] = asyncio.Queue()
        reader = asyncio.create_task(frontend._reader())
        await asyncio.sleep(0)  # the reader starts
        seen_first = replies.qsize()
        while replies.qsize() < 500:
            await asyncio.sleep(0)
        reader.cancel()
        return seen_first

    assert asyncio.run(main()) < 500
