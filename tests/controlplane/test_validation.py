"""Validation rules that the live-server tests (tests/integration/test_api.py) cannot reach with
their checkpoint and flags."""

import re

import pytest

from controlplane.validation import Limits, ValidationError, sampling_params, validate_prompt
from protos import generation_pb2


def test_logprobs_are_capped_by_the_vocabulary_too():
    """--max-logprobs above the vocabulary size: the data plane's top-N cannot be larger."""
    limits = Limits(max_model_len=64, vocab_size=10, max_total_tokens=64, max_logprobs=20)
    assert sampling_params(generation_pb2.SamplingParams(logprobs=10), 4, limits).logprobs == 10
    with pytest.raises(ValidationError, match=r"sampling.logprobs: at most 10, got 11"):
        sampling_params(generation_pb2.SamplingParams(logprobs=11), 4, limits)


@pytest.mark.parametrize("ids,field,token,is_unsigned", [([1, 10, 3, 12], "prompt[1]", 10, False),
                                                         ([1, 10, 3, 12], "prompt[1]", 10, True),
                                                         ([1, -1, 30], "prompt[1]", -1, False)])
def test_a_prompt_token_outside_the_vocabulary_is_named_by_its_first_index(ids, field, token,
                                                                            is_unsigned):
    """The gRPC API's ids are unsigned (only their maximum is checked); LLM.generate's are
    Python ints and can be negative."""
    limits = Limits(max_model_len=64, vocab_size=10, max_total_tokens=64, max_logprobs=20)
    validate_prompt([0, 9, 5], "prompt", limits, is_unsigned)
    with pytest.raises(ValidationError, match=rf"{re.escape(field)}: token id {token} is outside "
                                              r"the vocabulary \[0, 10\)"):
        validate_prompt(ids, "prompt", limits, is_unsigned)


@pytest.mark.parametrize("ids", [[1, float("nan")], [float("nan"), -1], [1, 3.5], [1, 2 ** 64]])
def test_prompt_ids_that_are_not_integers_in_range_are_refused(ids):
    """min and max let NaN through (every comparison with it is False); floats would reach the
    step codec's int32 packing."""
    limits = Limits(max_model_len=64, vocab_size=10, max_total_tokens=64, max_logprobs=20)
    with pytest.raises(ValidationError, match=r"^prompt: token ids must be integers in \[0, 10\)"):
        validate_prompt(ids, "prompt", limits)
