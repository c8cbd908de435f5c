"""Scheduler decisions -> link Step messages, and StepResults -> tokens and logprobs."""

from dataclasses import dataclass

from common.wire import pack_i32, unpack_f32, unpack_i32
from controlplane.request import Request
from controlplane.scheduler import SchedulerOutput
from protos import link_pb2


@dataclass(frozen=True)
class TokenLogprobs:
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first


def sampling_options(request: Request) -> link_pb2.SamplingOptions:
    s = request.sampling
    options = link_pb2.SamplingOptions(
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p,
        presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty, min_tokens=s.min_tokens)
    if s.seed is not None:
        options.seed = s.seed
    if s.logprobs is not None:
        options.logprobs = s.logprobs
    if s.min_tokens:
        options.suppressed_token_ids = pack_i32((*request.eos_token_ids, *s.stop_token_ids))
    return options


def encode_step(step_id: int, previous_step_id: int, out: SchedulerOutput) -> link_pb2.Step:
    step = link_pb2.Step(step_id=step_id, previous_step_id=previous_step_id,
                         freed_slots=pack_i32(out.freed_slots))
    slots, first_positions, num_tokens, num_blocks, block_ids = [], [], [], [], []
    for s in out.scheduled:
        r = s.request
        if s.is_new:
            step.new_requests.append(link_pb2.NewRequest(
                slot=r.slot, request_id=r.request_id, token_ids=pack_i32(r.token_ids),
                num_prompt_tokens=r.num_prompt_tokens, sampling=sampling_options(r)))
        slots.append(r.slot)
        first_positions.append(r.num_computed_tokens - s.num_tokens)  # advanced at scheduling
        num_tokens.append(s.num_tokens)
        num_blocks.append(len(s.new_block_ids))
        block_ids.extend(s.new_block_ids)
    step.slots = pack_i32(slots)
    step.num_computed_tokens = pack_i32(first_positions)
    step.num_scheduled_tokens = pack_i32(num_tokens)
    step.num_new_blocks = pack_i32(num_blocks)
    step.new_block_ids = pack_i32(block_ids)
    return step


class MalformedResult(ValueError):
    """A StepResult that does not fit the step it answers: its data plane is not to be trusted."""


def decode_result(result: link_pb2.StepResult, out: SchedulerOutput, vocab_size: int
                  ) -> tuple[list[int], list[TokenLogprobs | None]]:
    """Sampled tokens in batch order, and the logprobs of each (None where not asked for).
    Raises MalformedResult unless there is one token in [0, vocab_size) per sampling request and
    logprobs for exactly those that asked."""
    try:
        tokens = list(unpack_i32(result.sampled_token_ids))
        sampled = unpack_f32(result.sampled_logprobs)
        top_ids, top_values = unpack_i32(result.top_token_ids), unpack_f32(result.top_logprobs)
    except ValueError as e:  # a length that is no multiple of 4
        raise MalformedResult(f"step {result.step_id}'s result: {e}") from None
    wanted = [s.request.sampling.logprobs for s in out.scheduled if s.samples]
    num_top = sum(n for n in wanted if n is not None)
    num_sampled = len(wanted) - wanted.count(None)
    if len(tokens) != len(wanted) or len(sampled) != num_sampled or \
            len(top_ids) != num_top or len(top_values) != num_top:
        raise MalformedResult(
            f"step {result.step_id}'s result has {len(tokens)} tokens, {len(sampled)} logprobs "
            f"and {len(top_ids)}/{len(top_values)} top ids/logprobs for {len(wanted)} sampling "
            f"requests, {num_sampled} of them asking for {num_top} top logprobs")
    if tokens and not (min(tokens) >= 0 and max(tokens) < vocab_size):
        raise MalformedResult(f"step {result.step_id}'s result has a token outside the "
                              f"vocabulary [0, {vocab_size}): {tokens}"[:300])
    logprobs: list[TokenLogprobs | None] = [None] * len(tokens)
    if not num_sampled:
        return tokens, logprobs
    offset = 0
    wanting = iter(sampled)
    for i, n in enumerate(wanted):
        if n is None:
            continue
        top = tuple(zip(top_ids[offset:offset + n], top_values[offset:offset + n]))
        logprobs[i] = TokenLogprobs(next(wanting), top)
        offset += n
    return tokens, logprobs
