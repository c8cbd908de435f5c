"""The engine loop against a fake data plane: losses, reattach, timeouts, poisonous requests,
per-request faults, drain."""

import asyncio
import contextlib

import pytest

from common.wire import pack_f32, pack_i32
from controlplane.dataplane_client import DataPlaneLost
from controlplane.engine import Attachment, Engine, EngineConfig, NotAccepting
from controlplane.request import FinishReason
from controlplane.scheduler import SchedulerConfig
from controlplane.tokenizer import Tokenizer
from dataplane.checkpoints import build_tokenizer
from tests.controlplane.factories import make_request
from tests.controlplane.fake_dataplane import FakeDataPlane

TOKENIZER = Tokenizer(build_tokenizer(320), 320)
pytestmark = pytest.mark.timeout(30)


def expected_tokens(prompt: list[int], n: int) -> list[int]:
    history = list(prompt)
    for _ in range(n):
        history.append((sum(history) * 31 + len(history)) % 97)
    return history[len(prompt):]


def run(body, config=EngineConfig(SchedulerConfig(max_num_seqs=4, max_model_len=64)), fake=None):
    async def main():
        dp = fake or FakeDataPlane()
        dp.connect()
        engine = Engine(config, TOKENIZER, dp)
        task = asyncio.create_task(engine.run())
        try:
            await asyncio.wait_for(until(lambda: engine.accepting), 5)
            return await asyncio.wait_for(body(engine, dp), 20)
        finally:
            engine.close()
            await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 5)
    return asyncio.run(main())


async def collect(stream):
    return [chunk async for chunk in stream]


async def until(predicate):
    while not predicate():
        await asyncio.sleep(0.001)


@contextlib.asynccontextmanager
async def restarted_when_lost(dp: FakeDataPlane):
    """Within: the fake data plane comes back whenever it is lost, as a supervisor brings one."""
    async def supervise():
        while True:
            if not dp.is_attached:
                dp.connect()
            await asyncio.sleep(0.001)
    supervisor = asyncio.create_task(supervise())
    try:
        yield
    finally:
        supervisor.cancel()


def tokens_of(chunks):
    return [t for c in chunks for t in c.token_ids]


PROMPTS = {"a": [1, 2, 3, 4, 5], "b": [9, 8], "c": [7] * 11}


@pytest.mark.parametrize("pipeline_depth", [1, 2, 3])
def test_streams_complete_with_the_data_planes_tokens(pipeline_depth):
    async def body(engine, dp):
        streams = {rid: engine.add_request(make_request(rid, p, max_tokens=6))
                   for rid, p in PROMPTS.items()}
        return {rid: await collect(s) for rid, s in streams.items()}

    results = run(body, EngineConfig(SchedulerConfig(max_num_seqs=4, max_model_len=64),
                                     pipeline_depth=pipeline_depth))
    for rid, chunks in results.items():
        assert tokens_of(chunks) == expected_tokens(PROMPTS[rid], 6)
        assert chunks[-1].finish_reason is FinishReason.LENGTH


def test_the_device_idle_counts_only_before_steps_sent_behind_another():
    """Each step says its device waited 2 ms and worked 3. The first step of a request that
    arrives at an idle engine goes out alone (the device waited for work, not for the host):
    its wait is not counted; every later one goes out while another is in flight. The work
    counts for every step."""
    class Idling(FakeDataPlane):
        async def execute(self, step, epoch, timeout_s):
            result = await super().execute(step, epoch, timeout_s)
            result.timings.device_idle_ms = 2.0
            result.timings.device_ms = 3.0
            return result

    async def body(engine, dp):
        await collect(engine.add_request(make_request("a", PROMPTS["a"], max_tokens=6)))
        return engine.num_steps, engine.step_times

    num_steps, times = run(body, fake=Idling())
    assert times.prompt.num_steps == 1 and times.prompt.device_idle_s == 0
    assert times.decode.device_idle_s == pytest.approx(0.002 * (num_steps - 1))
    assert times.prompt.device_s == pytest.approx(0.003)
    assert times.decode.device_s == pytest.approx(0.003 * (num_steps - 1))


def test_a_reader_that_falls_behind_gets_what_piled_up_in_one_chunk():
    async def body(engine, dp):
        stream = engine.add_request(make_request("a", PROMPTS["a"], max_tokens=12))
        chunks = aiter(stream)
        first = await anext(chunks)
        await until(lambda: engine.num_steps >= 6)  # steps go on while nobody reads
        return [first] + [chunk async for chunk in chunks]

    chunks = run(body)
    assert tokens_of(chunks) == expected_tokens(PROMPTS["a"], 12)
    assert len(chunks[1].token_ids) >= 4  # several steps' tokens in one message
    assert len(chunks) < 12 and chunks[-1].finish_reason is FinishReason.LENGTH


def test_stream_interval_sends_that_many_tokens_per_chunk_and_the_rest_at_the_end():
    config = EngineConfig(SchedulerConfig(max_num_seqs=4, max_model_len=64), stream_interval=4)

    async def body(engine, dp):
        streams = {rid: engine.add_request(make_request(rid, p, max_tokens=10))
                   for rid, p in PROMPTS.items()}
        return {rid: await collect(s) for rid, s in streams.items()}

    for rid, chunks in run(body, config).items():
        assert tokens_of(chunks) == expected_tokens(PROMPTS[rid], 10)
        assert all(len(c.token_ids) >= 4 for c in chunks[:-1]), [len(c.token_ids) for c in chunks]
        assert chunks[-1].finish_reason is FinishReason.LENGTH


def test_a_lost_data_plane_is_replaced_and_streams_continue_identically():
    async def body(engine, dp):
        dp.fail_at_step = (5, DataPlaneLost("killed"))
        streams = {rid: engine.add_request(make_request(rid, p, max_tokens=10))
                   for rid, p in PROMPTS.items()}
        await until(lambda: engine.attachment is Attachment.REATTACHING)
        assert engine.load()[2] == 0  # the lost cache's blocks are gone with it
        dp.connect()
        results = {rid: await collect(s) for rid, s in streams.items()}
        return results, engine.num_dataplane_losses, engine.load()

    results, losses, load = run(body)
    assert losses == 1 and load == (0, 0, 0, 64)
    for rid, chunks in results.items():
        assert tokens_of(chunks) == expected_tokens(PROMPTS[rid], 10)


def test_no_data_plane_within_the_reattach_timeout_ends_requests_unavailable():
    config = EngineConfig(SchedulerConfig(max_num_seqs=4, max_model_len=64), reattach_timeout_s=0.2)

    async def body(engine, dp):
        dp.fail_at_step = (3, DataPlaneLost("killed"))
        stream = engine.add_request(make_request("a", [1, 2, 3], max_tokens=50))
        await until(lambda: engine.attachment is Attachment.REATTACHING)
        queued = engine.add_request(make_request("b", [4, 5], max_tokens=5))  # accepted meanwhile
        chunks, queued_chunks = await collect(stream), await collect(queued)
        with pytest.raises(NotAccepting):
            engine.add_request(make_request("c", [1], max_tokens=1))
        dp.connect()
        await until(lambda: engine.attachment is Attachment.ATTACHED)
        after = await collect(engine.add_request(make_request("d", [1], max_tokens=2)))
        return chunks, queued_chunks, after

    chunks, queued_chunks, after = run(body, config)
    assert chunks[-1].finish_reason is FinishReason.UNAVAILABLE
    assert queued_chunks[-1].finish_reason is FinishReason.UNAVAILABLE
    assert after[-1].finish_reason is FinishReason.LENGTH


def test_no_data_plane_after_an_idle_loss_is_a_warning_not_an_error_about_zero_requests(caplog):
    config = EngineConfig(SchedulerConfig(max_num_seqs=4, max_model_len=64), reattach_timeout_s=0.1)

    async def body(engine, dp):
        dp.disconnect()
        engine.on_link_change(False)
        await until(lambda: engine.attachment is Attachment.DETACHED)

    with caplog.at_level("INFO", logger="splitserve.engine"):
        run(body, config)
    lines = [(r.levelname, r.getMessage()) for r in caplog.records]
    # the link's own reason (the line said "the link reports the data plane gone")
    assert ("WARNING", "data plane lost (the fake data plane went); no requests were running") in lines, lines
    assert ("WARNING", "no data plane within 0s: not serving until one attaches") in lines, lines
    assert not [line for line in lines if line[0] == "ERROR"], lines


def test_a_request_in_repeatedly_failing_steps_fails_alone():
    fake = FakeDataPlane()
    fake.poison_token = 66

    async def body(engine, dp):
        good = engine.add_request(make_request("good", [1, 2], max_tokens=5))
        poison = engine.add_request(make_request("poison", [66, 1], max_tokens=5))
        other = engine.add_request(make_request("other", [3, 4, 5], max_tokens=5))

        async with restarted_when_lost(dp):
            return (await collect(good), await collect(poison), await collect(other),
                    engine.load(), engine.num_dataplane_losses)

    good, poison, other, load, losses = run(body, fake=fake)
    # the batch fails once; then 'poison' fails alone twice while its batch-mates run on
    assert losses == 3
    assert poison[-1].finish_reason is FinishReason.ERROR and tokens_of(poison) == []
    assert tokens_of(good) == expected_tokens([1, 2], 5)
    assert tokens_of(other) == expected_tokens([3, 4, 5], 5)
    assert load[:3] == (0, 0, 0)


class LinkLikeDataPlane(FakeDataPlane):
    """Like the ZeroMQ link: a step's answer comes once the next step has run (or a moment
    later when none comes), and a step that fails fails every step in flight with its error,
    which names it."""

    def __init__(self) -> None:
        super().__init__()
        self.unanswered: list[asyncio.Future] = []

    async def execute(self, step, epoch, timeout_s):
        try:
            result = await super().execute(step, epoch, timeout_s)
        except DataPlaneLost as e:
            for earlier in self.unanswered:
                if not earlier.done():
                    earlier.set_exception(e)
            raise
        for earlier in self.unanswered:  # answered now
            if not earlier.done():
                earlier.set_result(None)
        mine = asyncio.get_running_loop().create_future()
        self.unanswered = [*self.unanswered, mine]
        try:
            await asyncio.wait_for(asyncio.shield(mine), 0.05)
        except TimeoutError:
            pass
        finally:
            self.unanswered.remove(mine)
        return result


def test_a_failed_step_blames_its_own_requests_not_the_step_in_flight_before_it():
    """'a' runs alone; 'poison' joins it in the next step, which fails while the step of 'a'
    alone is still unanswered. The failure is the later step's: both become suspects, and only
    'poison', failing alone twice, fails; blaming the earlier step made 'a' the culprit."""
    async def body(engine, dp):
        a = engine.add_request(make_request("a", [1, 2], max_tokens=30))
        await until(lambda: dp.num_steps >= 3)
        dp.poison_token = 66
        poison = engine.add_request(make_request("poison", [66, 1], max_tokens=5))
        async with restarted_when_lost(dp):
            return await collect(a), await collect(poison), engine.load()

    a, poison, load = run(body, fake=LinkLikeDataPlane())
    assert tokens_of(a) == expected_tokens([1, 2], 30) and a[-1].finish_reason is FinishReason.LENGTH
    assert poison[-1].finish_reason is FinishReason.ERROR
    assert load[:3] == (0, 0, 0)


def test_a_request_that_gets_tokens_between_failures_is_no_culprit():
    """Two unrelated failures (a killed rank, say) while 'a' runs alone, with tokens between:
    it stays a suspect for a step each time and finishes."""
    async def body(engine, dp):
        original = dp.execute

        async def failing(step, epoch, timeout_s):
            # the engine's third and tenth step fail (by id: with steps in flight, a count of
            # the fake's executed steps can reach the third call before the first one ends)
            if step.step_id in (3, 10):
                dp.disconnect()
                raise DataPlaneLost("a rank died", step.step_id)
            return await original(step, epoch, timeout_s)
        dp.execute = failing
        a = engine.add_request(make_request("a", [1, 2], max_tokens=20))
        async with restarted_when_lost(dp):
            return await collect(a), engine.num_dataplane_losses

    a, losses = run(body)
    assert losses == 2
    assert tokens_of(a) == expected_tokens([1, 2], 20) and a[-1].finish_reason is FinishReason.LENGTH


@pytest.mark.parametrize("mangle", [
    lambda r: setattr(r, "sampled_token_ids", r.sampled_token_ids[:-1]),  # not whole int32s
    lambda r: setattr(r, "sampled_token_ids", r.sampled_token_ids * 2),  # a token too many
    lambda r: setattr(r, "sampled_token_ids", b""),  # none
    lambda r: setattr(r, "sampled_token_ids", pack_i32([10 ** 6] * 3)),  # outside the vocabulary
    lambda r: setattr(r, "sampled_logprobs", pack_f32([-1.0])),  # logprobs nobody asked for
], ids=["partial", "extra", "none", "vocab", "logprobs"])
def test_a_result_that_does_not_fit_its_step_drops_the_data_plane_and_nothing_else(mangle):
    """A data plane that answers nonsense is given up on like a lost one: the engine carries
    on (its streams continue on the next data plane, identically), nothing is blamed."""
    async def body(engine, dp):
        streams = {rid: engine.add_request(make_request(rid, p, max_tokens=10))
                   for rid, p in PROMPTS.items()}
        original = dp.execute

        async def mangled(step, epoch, timeout_s):
            result = await original(step, epoch, timeout_s)
            if dp.num_steps == 4:
                mangle(result)
            return result
        dp.execute = mangled
        await until(lambda: dp.dropped is not None)
        dp.connect()
        return {rid: await collect(s) for rid, s in streams.items()}, dp.dropped, engine.load()

    results, dropped, load = run(body)
    assert "step" in dropped and load[:3] == (0, 0, 0)
    for rid, chunks in results.items():
        assert tokens_of(chunks) == expected_tokens(PROMPTS[rid], 10)


def test_a_fault_while_processing_one_request_fails_only_that_request():
    async def body(engine, dp):
        healthy = engine.add_request(make_request("ok", [1, 2, 3], max_tokens=6))
        broken = engine.add_request(make_request("broken", [4, 5, 6], max_tokens=6))

        def explode(token_id, may_stop=True):
            raise UnicodeError("detokenizer bug")
        broken.detokenizer.add = explode
        return await collect(healthy), await collect(broken), engine.load()

    healthy, broken, load = run(body)
    assert broken[-1].finish_reason is FinishReason.ERROR
    assert tokens_of(healthy) == expected_tokens([1, 2, 3], 6)
    assert load[:3] == (0, 0, 0)


def test_drain_lets_short_requests_finish_and_cuts_the_rest():
    async def body(engine, dp):
        short = engine.add_request(make_request("short", [1, 2], max_tokens=3))
        long = engine.add_request(make_request("long", [3, 4], max_tokens=60))
        original = dp.execute

        async def slow(*args):  # long enough that 'long' cannot finish within the drain
            await asyncio.sleep(0.01)
            return await original(*args)
        dp.execute = slow
        cut = await engine.drain(0.2)
        with pytest.raises(NotAccepting):
            engine.add_request(make_request("late", [1], max_tokens=1))
        return await collect(short), await collect(long), cut, engine.is_serving

    short, long, cut, serving = run(body)
    assert short[-1].finish_reason is FinishReason.LENGTH
    assert long[-1].finish_reason is FinishReason.SHUTDOWN
    assert cut == 1 and not serving


def test_close_ends_the_loop_in_any_state():
    """Idle, waiting to attach, or with steps in flight: run() returns after close()."""
    async def main():
        for state in ("idle", "detached", "busy"):
            dp = FakeDataPlane()
            if state != "detached":
                dp.connect()
            engine = Engine(EngineConfig(SchedulerConfig(max_num_seqs=4, max_model_len=64)),
                            TOKENIZER, dp)
            task = asyncio.create_task(engine.run())
            if state == "busy":
                await until(lambda: engine.accepting)
                engine.add_request(make_request("a", [1, 2], max_tokens=50))
                await until(lambda: dp.num_steps >= 2)
            await asyncio.sleep(0.01)
            engine.close()
            await asyncio.wait_for(task, 2)

    asyncio.run(main())


def test_an_idle_engine_notices_a_loss_at_once():
    async def body(engine, dp):
        await collect(engine.add_request(make_request("a", [1], max_tokens=2)))
        dp.disconnect()
        engine.on_link_change(False)
        await until(lambda: engine.attachment is Attachment.REATTACHING)
        return engine.num_dataplane_losses

    assert run(body) == 1


def test_many_streams_whose_steps_come_back_at_once_get_every_token_in_order():
    """More streams than the engine wakes in one turn, read concurrently, and a data plane that
    answers at once: every stream still gets all of its tokens, in order, and its end."""
    config = EngineConfig(SchedulerConfig(max_num_seqs=64, max_model_len=64))

    async def body(engine, dp):
        prompts = {f"r{i}": [i + 1, 2 * i + 3] for i in range(48)}
        streams = {rid: engine.add_request(make_request(rid, p, max_tokens=12))
                   for rid, p in prompts.items()}
        chunks = await asyncio.gather(*(collect(s) for s in streams.values()))
        return prompts, dict(zip(streams, chunks))

    prompts, results = run(body, config, FakeDataPlane(num_kv_blocks=256))
    for rid, chunks in results.items():
        assert tokens_of(chunks) == expected_tokens(prompts[rid], 12)
        assert chunks[-1].finish_reason is FinishReason.LENGTH
