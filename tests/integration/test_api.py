"""The public API against a live server: validation, stops, sampling, logprobs, cancellation,
RPCs. Every bad request is followed by a good one that succeeds."""

import asyncio
import concurrent.futures
import math

import grpc
import pytest
import torch

from protos import generation_pb2
from splitserve.client import AsyncClient, build_request
from tests.integration import harness
from tests.reference import hf_greedy, hf_logprobs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
MAX_MODEL_LEN = 512  # the test checkpoint's max_position_embeddings
VOCAB = 320


@pytest.fixture(scope="module")
def model(checkpoints):
    return checkpoints["untied"]


@pytest.fixture(scope="module", params=["1", "0"], ids=["frontend", "grpc-in-engine"])
def server(model, tmp_path_factory, request):
    """The API through a gRPC front-end process (the default), and served by the engine's
    process itself (--frontends 0)."""
    s = harness.serve(model, tmp_path_factory.mktemp("api"), "--block-size", "4",
                      "--num-kv-blocks", "512", "--max-num-seqs", "32",
                      "--frontends", request.param)
    yield s
    s.stop()


def good_request(server):
    completion = server.client.generate([1, 2, 3], max_tokens=3, temperature=0, ignore_eos=True)
    assert completion.completion_tokens == 3


def req(**kwargs) -> generation_pb2.GenerateRequest:
    prompt = kwargs.pop("prompt", [1, 2, 3])
    request_id = kwargs.pop("request_id", "")
    return build_request(prompt, request_id, **kwargs)


def no_input():
    return generation_pb2.GenerateRequest()


def empty_ids():
    r = generation_pb2.GenerateRequest()
    r.token_ids.SetInParent()
    return r


BAD = {
    "no input": (no_input, ["input", "text or token_ids"]),
    "empty text": (lambda: req(prompt=""), ["input.text", "empty"]),
    "empty token ids": (empty_ids, ["input.token_ids.ids", "0 tokens"]),
    "prompt too long": (lambda: req(prompt=[1] * MAX_MODEL_LEN), ["max_model_len is 512", "512 tokens"]),
    "prompt + max_tokens": (lambda: req(prompt=[1] * 500, max_tokens=20), ["max_tokens", "520", "512"]),
    "max_tokens 0": (lambda: req(max_tokens=0), ["sampling.max_tokens", ">= 1", "got 0"]),
    "token outside vocab": (lambda: req(prompt=[1, VOCAB]), ["input.token_ids.ids[1]", "320", "[0, 320)"]),
    "negative temperature": (lambda: req(temperature=-0.5), ["sampling.temperature", ">= 0", "-0.5"]),
    "nan temperature": (lambda: req(temperature=math.nan), ["sampling.temperature", "nan"]),
    "inf temperature": (lambda: req(temperature=math.inf), ["sampling.temperature", "inf"]),
    "top_p 0": (lambda: req(top_p=0.0), ["sampling.top_p", "(0, 1]", "0.0"]),
    "top_p above 1": (lambda: req(top_p=1.5), ["sampling.top_p", "(0, 1]", "1.5"]),
    "top_k below -1": (lambda: req(top_k=-2), ["sampling.top_k", ">= -1", "-2"]),
    "min_p negative": (lambda: req(min_p=-0.25), ["sampling.min_p", "[0, 1]", "-0.25"]),
    "min_p above 1": (lambda: req(min_p=1.5), ["sampling.min_p", "[0, 1]", "1.5"]),
    "repetition_penalty 0": (lambda: req(repetition_penalty=0.0), ["sampling.repetition_penalty", "> 0", "0.0"]),
    "presence_penalty": (lambda: req(presence_penalty=2.5), ["sampling.presence_penalty", "[-2, 2]", "2.5"]),
    "frequency_penalty": (lambda: req(frequency_penalty=-3.0), ["sampling.frequency_penalty", "[-2, 2]", "-3.0"]),
    "min_tokens > max_tokens": (lambda: req(max_tokens=4, min_tokens=5), ["sampling.min_tokens", "(5)", "(4)"]),
    "empty stop string": (lambda: req(stop=["ok", ""]), ["sampling.stop[1]", "empty"]),
    "too many stop strings": (lambda: req(stop=[f"s{i}" for i in range(17)]), ["sampling.stop", "17", "16"]),
    "stop string too long": (lambda: req(stop=["x" * 257]), ["sampling.stop[0]", "257", "256"]),
    "stop token outside vocab": (lambda: req(stop_token_ids=[5, 999]), ["sampling.stop_token_ids[1]", "999"]),
    "logprobs above cap": (lambda: req(logprobs=21), ["sampling.logprobs", "20", "21"]),
    "request_id too long": (lambda: req(request_id="r" * 300), ["request_id", "300", "256"]),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_invalid_argument_naming_field_limit_value(server, case):
    make, expected = BAD[case]
    with pytest.raises(grpc.RpcError) as error:
        list(server.client.stub.Generate(make(), timeout=30))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, error.value.details()
    for text in expected:
        assert text in error.value.details(), (text, error.value.details())
    good_request(server)


# Bytes no protobuf library of ours would write: a string field holding bad UTF-8, a cut message.
MALFORMED = {
    "Generate text": ("Generate", b"\x12\x02\xff\xfe", "GenerateRequest"),
    "Generate cut": ("Generate", b"\x1a\x05\x0a\x03", "GenerateRequest"),
    "Tokenize text": ("Tokenize", b"\x0a\x01\xff", "TokenizeRequest"),
    "Abort request id": ("Abort", b"\x0a\x01\xc3", "AbortRequest"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_request_that_does_not_parse_is_invalid_argument(server, case):
    method, data, message = MALFORMED[case]
    path = f"/{generation_pb2.DESCRIPTOR.services_by_name['Generation'].full_name}/{method}"
    with grpc.insecure_channel(server.address) as channel:
        call = channel.unary_stream(path) if method == "Generate" else channel.unary_unary(path)
        with pytest.raises(grpc.RpcError) as error:
            response = call(data, timeout=30)
            list(response) if method == "Generate" else response
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, error.value.details()
    assert message in error.value.details()
    good_request(server)


def test_duplicate_live_request_id_is_refused(server):
    # as many tokens as fit: still running when the duplicate arrives, on a loaded machine too
    stream = server.client.generate_stream([1, 2], request_id="dup", ignore_eos=True)
    next(stream)
    with pytest.raises(grpc.RpcError) as error:
        server.client.generate([1, 2], request_id="dup", max_tokens=2)
    assert error.value.code() == grpc.StatusCode.ALREADY_EXISTS
    stream.cancel()
    good_request(server)


def test_unset_max_tokens_means_as_many_as_fit(server):
    c = server.client.generate([1] * 500, temperature=0, ignore_eos=True)
    assert c.completion_tokens == MAX_MODEL_LEN - 500 and c.finish_reason == "length"


def greedy_chunks(server, prompt, n):
    return list(server.client.generate_stream(prompt, max_tokens=n, temperature=0, ignore_eos=True))


def test_stop_string_spanning_chunks_never_reaches_the_client(server):
    prompt = [5, 17, 99, 3]
    # 150 tokens: enough messages for a boundary even when a busy front-end merges some
    texts = [c.text for c in greedy_chunks(server, prompt, 150)]
    full = "".join(texts)
    # a two-character stop string whose first occurrence straddles a chunk boundary
    stop, start = None, 0
    for i in range(len(texts) - 1):
        start += len(texts[i])
        if texts[i] and texts[i + 1]:
            candidate = texts[i][-1] + texts[i + 1][0]
            if full.find(candidate) == start - 1:
                stop = candidate
                break
    assert stop is not None, f"no usable boundary in {texts!r}"
    chunks = list(server.client.generate_stream(prompt, max_tokens=150, temperature=0,
                                                ignore_eos=True, stop=["never-there", stop]))
    assert "".join(c.text for c in chunks) == full[:full.find(stop)]
    assert chunks[-1].finish_reason == generation_pb2.FINISH_REASON_STOP
    assert server.wait_idle()


def test_stop_token_id_is_returned_and_ends_the_request(server):
    prompt = [9, 8, 7]
    tokens = [t for c in greedy_chunks(server, prompt, 12) for t in c.token_ids]
    stop_id = tokens[4]
    first = tokens.index(stop_id)
    c = server.client.generate(prompt, max_tokens=12, temperature=0, ignore_eos=True,
                               stop_token_ids=[stop_id])
    assert c.token_ids == tokens[:first + 1] and c.finish_reason == "stop"
    # min_tokens suppresses the stop id until then
    c = server.client.generate(prompt, max_tokens=12, temperature=0, ignore_eos=True,
                               stop_token_ids=[stop_id], min_tokens=first + 2)
    assert stop_id not in c.token_ids[:first + 2]


def test_stop_strings_wait_for_min_tokens_and_one_on_the_last_token_reads_stop(server):
    """As in vLLM: a stop string counts from the token after min_tokens on, and one completed by
    the last token max_tokens allows still cuts the text and ends the request with STOP."""
    prompt = [5, 17, 99, 3]
    token_ids = [t for c in greedy_chunks(server, prompt, 40) for t in c.token_ids]
    full = server.client.detokenize(token_ids)
    stop = next(full[i:i + 2] for i in range(len(full) - 1)
                if full[i:i + 2].strip() and "\ufffd" not in full[i:i + 2])
    # the token that completes its first occurrence
    ends = next(n for n in range(1, 41) if stop in server.client.detokenize(token_ids[:n]))
    kwargs = dict(temperature=0, ignore_eos=True, stop=[stop])
    c = server.client.generate(prompt, max_tokens=ends, **kwargs)
    assert (c.text, c.completion_tokens, c.finish_reason) == (full[:full.find(stop)], ends, "stop")
    c = server.client.generate(prompt, max_tokens=40, min_tokens=ends, **kwargs)
    assert c.completion_tokens > ends and full.startswith(c.text)
    assert c.finish_reason == ("stop" if c.completion_tokens < 40 else "length")
    assert server.wait_idle()


def test_a_temperature_below_the_floor_samples_at_the_floor(server):
    """vLLM's floor of 0.01: dividing the logits by 1e-38 overflowed to inf, and the sampler drew
    from NaN probabilities."""
    kwargs = dict(max_tokens=12, seed=7, ignore_eos=True)
    tiny = server.client.generate([40, 41, 42], temperature=1e-38, **kwargs)
    assert tiny.token_ids == server.client.generate([40, 41, 42], temperature=0.01,
                                                    **kwargs).token_ids


def test_a_huge_text_prompt_is_refused_without_stalling_the_engine(server):
    """3.8 MB of text takes the tokenizer about 2 s. It runs off the engine's event loop, whose
    steps and data-plane heartbeats go on meanwhile: on it, the link declared the data plane
    lost and killed it."""
    losses = server.client.load().num_dataplane_losses
    with pytest.raises(grpc.RpcError) as error:
        server.client.generate("lorem ipsum dolor " * 210_000, max_tokens=1)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details().startswith("input.text: the prompt has ")
    assert server.client.load().num_dataplane_losses == losses
    good_request(server)


def test_seeded_sampling_is_reproducible_across_runs_and_batches(server):
    prompt = [40, 41, 42, 43]
    kwargs = dict(max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
    alone = server.client.generate(prompt, **kwargs).token_ids
    assert server.client.generate(prompt, **kwargs).token_ids == alone
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        noise = [pool.submit(server.client.generate, [i, i + 1] * (i + 1), max_tokens=20,
                             temperature=1.0, ignore_eos=True) for i in range(5)]
        together = pool.submit(server.client.generate, prompt, **kwargs)
        assert together.result().token_ids == alone
        [f.result() for f in noise]
    other_seed = server.client.generate(prompt, **{**kwargs, "seed": 99}).token_ids
    assert other_seed != alone


def test_top_k_1_equals_greedy(server, model):
    prompt = [3, 1, 4, 1, 5]
    c = server.client.generate(prompt, max_tokens=10, temperature=1.3, top_k=1, ignore_eos=True)
    assert c.token_ids == hf_greedy(model, prompt, 10)


def test_logprobs_match_transformers(server, model):
    prompt = [2, 7, 1, 8, 2, 8]
    c = server.client.generate(prompt, max_tokens=6, temperature=0, ignore_eos=True, logprobs=5)
    assert len(c.logprobs) == 6
    reference = hf_logprobs(model, prompt + c.token_ids)
    for i, (token, lp) in enumerate(zip(c.token_ids, c.logprobs)):
        row = reference[len(prompt) - 1 + i]
        assert abs(lp.logprob - row[token].item()) < 1e-4
        top = row.topk(5)
        assert [t.token_id for t in lp.top] == top.indices.tolist()
        torch.testing.assert_close(torch.tensor([t.logprob for t in lp.top]), top.values,
                                   atol=1e-4, rtol=0)


def test_abort_rpc_ends_the_stream_and_is_idempotent(server):
    stream = server.client.generate_stream([1, 2, 3], request_id="to-abort", ignore_eos=True)
    next(stream)
    assert server.client.abort("to-abort", "unknown") == 1
    last = list(stream)[-1]
    assert last.finish_reason == generation_pb2.FINISH_REASON_ABORTED
    assert server.client.abort("to-abort") == 0
    assert server.wait_idle()


def test_small_rpcs(server):
    info = server.client.model_info()
    assert (info.max_model_len, info.vocab_size, info.block_size, info.tp_size, info.dtype,
            info.attention_backend) == (MAX_MODEL_LEN, VOCAB, 4, 1, "float32", "torch")
    ids = server.client.tokenize("hello world")
    assert ids and server.client.detokenize(ids) == "hello world"
    with pytest.raises(grpc.RpcError) as error:
        server.client.detokenize([1, 5000])
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "token_ids[1]" in error.value.details()


def test_the_async_client_checks_health_as_the_blocking_one_does(server):
    async def run():
        async with AsyncClient(server.address) as client:
            with pytest.raises(grpc.RpcError) as error:
                await client.health("bogus")
            return (await client.health(), await client.health("liveness"),
                    await client.is_serving(), await client.wait_until_serving(5),
                    error.value.code())
    assert asyncio.run(run()) == ("SERVING", "SERVING", True, True, grpc.StatusCode.NOT_FOUND)
    assert server.client.health() == "SERVING"


def test_load_counts_prompt_and_decode_steps_with_the_data_planes_timings(server):
    before = server.client.load()
    server.client.generate(list(range(1, 40)), max_tokens=6, temperature=0, ignore_eos=True)
    after = server.client.load()
    steps = after.num_steps - before.num_steps
    prompt_steps = after.num_prompt_steps - before.num_prompt_steps
    assert prompt_steps >= 1 and steps - prompt_steps >= 4  # one prompt, five more tokens
    for kind in ("prompt", "decode"):
        host = getattr(after, f"{kind}_step_host_seconds") - \
            getattr(before, f"{kind}_step_host_seconds")
        total = getattr(after, f"{kind}_step_total_seconds") - \
            getattr(before, f"{kind}_step_total_seconds")
        assert 0 < host <= total, kind
        assert getattr(after, f"{kind}_step_device_idle_seconds") == 0, kind  # (on CPU)
        assert getattr(after, f"{kind}_step_device_seconds") == 0, kind


def test_200_streams_with_cancels_and_deadlines_leave_nothing_behind(server):
    async def one(client, i):
        call = client.generate_stream([i % 300 + 1, 2, 3, 4], max_tokens=10 + i % 30,
                                      temperature=0.8, ignore_eos=True,
                                      timeout=0.3 if i % 7 == 0 else 60)
        # cancelled after its first message: a later one may never come on its own, as a
        # busy front-end merges the tokens that piled up into one message
        return await harness.stream_outcome(call, cancel_after=1 if i % 3 == 0 else None)

    async def run():
        async with AsyncClient(server.address) as client:
            return await asyncio.gather(*(one(client, i) for i in range(200)))

    outcomes = asyncio.run(run())
    assert outcomes.count("cancelled") >= 50 and outcomes.count("done") >= 50
    assert set(outcomes) <= {"cancelled", "done", "DEADLINE_EXCEEDED", "CANCELLED"}
    assert server.wait_idle()
    good_request(server)


def test_burst_beyond_the_queue_bound_fails_fast_while_admitted_requests_complete(model, tmp_path):
    s = harness.serve(model, tmp_path, "--block-size", "4", "--num-kv-blocks", "256",
                      "--max-num-seqs", "2", "--max-waiting-requests", "3")
    try:
        def call(i):
            try:
                return s.client.generate([i + 1, 2], max_tokens=40, ignore_eos=True).finish_reason
            except grpc.RpcError as e:
                return e.code().name
        with concurrent.futures.ThreadPoolExecutor(24) as pool:
            results = list(pool.map(call, range(24)))
        assert results.count("RESOURCE_EXHAUSTED") >= 1
        assert results.count("length") >= 2
        assert set(results) == {"RESOURCE_EXHAUSTED", "length"}
        good_request(s)
    finally:
        s.stop()


def test_the_queue_bound_counts_only_requests_beyond_the_free_sequence_slots(model, tmp_path):
    """--max-waiting-requests 0: no queue. A burst that fits --max-num-seqs all runs (it waits
    for no slot, though no step has admitted it yet); with every slot taken one more is refused."""
    s = harness.serve(model, tmp_path, "--block-size", "4", "--num-kv-blocks", "512",
                      "--max-num-seqs", "4", "--max-waiting-requests", "0")
    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            finishes = list(pool.map(lambda i: s.client.generate(
                [i + 1, 2], max_tokens=8, ignore_eos=True).finish_reason, range(4)))
        assert finishes == ["length"] * 4
        streams = [s.client.generate_stream([i + 1, 2], max_tokens=400, ignore_eos=True)
                   for i in range(4)]
        assert all(next(stream).token_ids for stream in streams)  # all four are running
        with pytest.raises(grpc.RpcError) as refused:
            s.client.generate([1, 2], max_tokens=1)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-waiting-requests" in refused.value.details()
        assert [list(stream)[-1].finish_reason for stream in streams] == \
            [generation_pb2.FINISH_REASON_LENGTH] * 4
        good_request(s)
    finally:
        s.stop()


def test_stream_interval_sends_at_least_that_many_tokens_per_message(model, server, tmp_path):
    s = harness.serve(model, tmp_path, "--block-size", "4", "--num-kv-blocks", "256",
                      "--stream-interval", "4")
    try:
        prompt = [5, 17, 99, 3]
        chunks = list(s.client.generate_stream(prompt, max_tokens=18, temperature=0,
                                               ignore_eos=True))
    finally:
        s.stop()
    assert [len(c.token_ids) >= 4 for c in chunks[:-1]] == [True] * (len(chunks) - 1)
    assert chunks[-1].finish_reason == generation_pb2.FINISH_REASON_LENGTH
    expected = server.client.generate(prompt, max_tokens=18, temperature=0, ignore_eos=True)
    assert [t for c in chunks for t in c.token_ids] == expected.token_ids
    assert "".join(c.text for c in chunks) == expected.text
