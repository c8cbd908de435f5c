"""The front-end link: replies to a front-end that is not reading queue without loss; a burst of
calls does not hold the engine's next step back; the front-end's merging of Generate responses
that piled up for one stream."""

import asyncio
import time
import types

import pytest
import zmq
import zmq.asyncio

from common.model_info import ModelInfo
from common.transport import private_ipc_address
from controlplane.api_server import GenerationServicer
from controlplane.engine import Engine, EngineConfig
from controlplane.frontend import _merged
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
    async def generate(request, context):
        await asyncio.sleep(60)
        yield pb.GenerateResponse()

    async def get_load(request, context):
        return pb.Load(num_running=7)

    def call(call_id: int, method: str, request) -> bytes:
        return frontend_pb2.ToEngine(call=frontend_pb2.Call(
            call_id=call_id, method=method, request=request.SerializeToString())).SerializeToString()

    async def main():
        servicer = types.SimpleNamespace(**{m.name: None for m in SERVICE.methods})
        servicer.Generate, servicer.GetLoad = generate, get_load
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
        dataplane.connect()
        engine = dataplane.engine = Engine(
            EngineConfig(SchedulerConfig(max_num_seqs=64, max_model_len=64)),
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
        for call_id in range(40):
            await frontend.send(frontend_pb2.ToEngine(call=frontend_pb2.Call(
                call_id=call_id, method="Generate", request=pb.GenerateRequest(
                    token_ids=pb.TokenIds(ids=[1, 2, 3, call_id + 4]),
                    sampling=pb.SamplingParams(max_tokens=2)).SerializeToString()))
                .SerializeToString())
        time.sleep(0.2)  # (blocking: the loop reads nothing while ZeroMQ delivers the burst)
        num_done = 0
        while num_done < 40:
            message = frontend_pb2.ToFrontend.FromString(await asyncio.wait_for(frontend.recv(), 10))
            num_done += sum(r.done for r in message.replies)
        frontend.close()
        await link.close()
        engine.close()
        await task
        return dataplane.admitted_at_first_step

    assert 1 <= asyncio.run(main()) < 40


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
