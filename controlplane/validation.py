"""Validation at the edge: every client mistake becomes a ValidationError that names the field,
the limit and the value, and the servicer turns it into INVALID_ARGUMENT."""

import math
from array import array
from dataclasses import dataclass

from controlplane.sampling_params import SamplingParams
from protos import generation_pb2


class ValidationError(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class Limits:
    max_model_len: int
    vocab_size: int
    # Tokens one request may hold in the KV cache (prompt + output); <= max_model_len.
    max_total_tokens: int
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    max_stop_token_ids: int = 64
    max_logprobs: int = 20
    max_request_id_chars: int = 256


# A temperature above 0 and below this samples at this one, as in vLLM (which warns and does the
# same); 0 is greedy.
MIN_TEMPERATURE = 0.01


def _require(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ValidationError(field, message)


def validate_prompt(token_ids: list[int], field: str, limits: Limits,
                    is_unsigned: bool = False) -> None:
    """`is_unsigned`: the ids are known to be integers >= 0 (a proto's uint32 field, a tokenizer's
    output), so only their maximum is checked."""
    _require(len(token_ids) > 0, field, "the prompt is empty (0 tokens); give at least one")
    # min and max run in C; a per-id Python loop took 62 ms for workload A's 256 prompts
    # (144k ids) on this machine, all of it before the first step. The array takes integers
    # only (LLM.generate's ids are Python values: a float or NaN would pass min and max); min
    # and max then walk the list, whose items exist, not the array, which makes an int object
    # for each item it yields: 49 against 70 us a prompt over workload A's 256 on this machine.
    if not is_unsigned:
        try:
            array("q", token_ids)
        except (TypeError, OverflowError) as e:
            raise ValidationError(field, f"token ids must be integers in [0, "
                                         f"{limits.vocab_size}): {e}") from None
    outside = (not is_unsigned and min(token_ids) < 0) or max(token_ids) >= limits.vocab_size
    if outside:
        i, token = next((i, t) for i, t in enumerate(token_ids)
                        if not 0 <= t < limits.vocab_size)
        raise ValidationError(f"{field}[{i}]", f"token id {token} is outside the vocabulary "
                                               f"[0, {limits.vocab_size})")
    n = len(token_ids)
    _require(n < limits.max_model_len, field,
             f"the prompt has {n} tokens; max_model_len is {limits.max_model_len}, so at most "
             f"{limits.max_model_len - 1} prompt tokens fit")
    _require(n < limits.max_total_tokens, field,
             f"the prompt has {n} tokens; the KV cache holds at most {limits.max_total_tokens} "
             "tokens per request")


def validate_request_id(request_id: str, limits: Limits) -> None:
    _require(len(request_id) <= limits.max_request_id_chars, "request_id",
             f"{len(request_id)} characters; at most {limits.max_request_id_chars}")


def sampling_params(proto: generation_pb2.SamplingParams, num_prompt_tokens: int,
                    limits: Limits) -> SamplingParams:
    """Check every field and resolve defaults. `num_prompt_tokens` must be validated already."""
    room = min(limits.max_model_len, limits.max_total_tokens) - num_prompt_tokens
    max_tokens = proto.max_tokens if proto.HasField("max_tokens") else room
    _require(max_tokens >= 1, "sampling.max_tokens", f"must be >= 1, got {max_tokens}")
    _require(num_prompt_tokens + max_tokens <= limits.max_model_len, "sampling.max_tokens",
             f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = "
             f"{num_prompt_tokens + max_tokens} exceeds max_model_len {limits.max_model_len}")
    _require(num_prompt_tokens + max_tokens <= limits.max_total_tokens, "sampling.max_tokens",
             f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds the "
             f"{limits.max_total_tokens} tokens one request can hold in the KV cache")
    p = proto
    temperature = _float(p, "temperature", 1.0, lambda v: v >= 0, ">= 0")
    if 0 < temperature < MIN_TEMPERATURE:  # logits divided by less can overflow to inf: NaN
        temperature = MIN_TEMPERATURE
    top_p = _float(p, "top_p", 1.0, lambda v: 0 < v <= 1, "in (0, 1]")
    min_p = _float(p, "min_p", 0.0, lambda v: 0 <= v <= 1, "in [0, 1]")
    repetition = _float(p, "repetition_penalty", 1.0, lambda v: v > 0, "> 0")
    presence = _float(p, "presence_penalty", 0.0, lambda v: -2 <= v <= 2, "in [-2, 2]")
    frequency = _float(p, "frequency_penalty", 0.0, lambda v: -2 <= v <= 2, "in [-2, 2]")
    top_k = p.top_k if p.HasField("top_k") else 0
    _require(top_k >= -1, "sampling.top_k", f"must be >= -1 (-1 or 0 turn it off), got {top_k}")
    min_tokens = p.min_tokens if p.HasField("min_tokens") else 0
    _require(min_tokens <= max_tokens, "sampling.min_tokens",
             f"min_tokens ({min_tokens}) exceeds max_tokens ({max_tokens})")
    logprobs = p.logprobs if p.HasField("logprobs") else None
    max_logprobs = min(limits.max_logprobs, limits.vocab_size)  # (the sampler's top-N)
    _require(logprobs is None or logprobs <= max_logprobs, "sampling.logprobs",
             f"at most {max_logprobs}, got {logprobs}")
    _check_stops(p, limits)
    return SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=max(top_k, 0),
        min_p=min_p, presence_penalty=presence, frequency_penalty=frequency,
        repetition_penalty=repetition, seed=p.seed if p.HasField("seed") else None,
        stop=tuple(p.stop), stop_token_ids=tuple(p.stop_token_ids), ignore_eos=p.ignore_eos,
        min_tokens=min_tokens, logprobs=logprobs)


def _float(proto: generation_pb2.SamplingParams, name: str, default: float, ok, rule: str) -> float:
    value = getattr(proto, name) if proto.HasField(name) else default
    _require(math.isfinite(value) and ok(value), f"sampling.{name}", f"must be {rule}, got {value}")
    return value


def _check_stops(p: generation_pb2.SamplingParams, limits: Limits) -> None:
    _require(len(p.stop) <= limits.max_stop_strings, "sampling.stop",
             f"{len(p.stop)} stop strings; at most {limits.max_stop_strings}")
    for i, stop in enumerate(p.stop):
        _require(len(stop) > 0, f"sampling.stop[{i}]", "stop strings must not be empty")
        _require(len(stop) <= limits.max_stop_string_chars, f"sampling.stop[{i}]",
                 f"{len(stop)} characters; at most {limits.max_stop_string_chars}")
    _require(len(p.stop_token_ids) <= limits.max_stop_token_ids, "sampling.stop_token_ids",
             f"{len(p.stop_token_ids)} ids; at most {limits.max_stop_token_ids}")
    for i, token in enumerate(p.stop_token_ids):
        _require(token < limits.vocab_size, f"sampling.stop_token_ids[{i}]",
                 f"token id {token} is outside the vocabulary [0, {limits.vocab_size})")
