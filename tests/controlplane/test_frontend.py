"""The front-end's merging of Generate responses that piled up for one stream."""

from controlplane.frontend import _merged
from protos import generation_pb2 as pb


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
