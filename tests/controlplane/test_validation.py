"""Validation rules that the live-server tests (tests/integration/test_api.py) cannot reach with
their checkpoint and flags."""

import pytest

from controlplane.validation import Limits, ValidationError, sampling_params
from protos import generation_pb2


def test_logprobs_are_capped_by_the_vocabulary_too():
    """--max-logprobs above the vocabulary size: the data plane's top-N cannot be larger."""
    limits = Limits(max_model_len=64, vocab_size=10, max_total_tokens=64, max_logprobs=20)
    assert sampling_params(generation_pb2.SamplingParams(logprobs=10), 4, limits).logprobs == 10
    with pytest.raises(ValidationError, match=r"sampling.logprobs: at most 10, got 11"):
        sampling_params(generation_pb2.SamplingParams(logprobs=11), 4, limits)
