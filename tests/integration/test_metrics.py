"""Prometheus metrics (--metrics-port) from a live server, read as Prometheus reads them."""

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration import harness

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def scrape(port: int, model_name: str) -> dict[tuple[str, tuple], float]:
    """Every sample, by name and labels but model_name (which every sample has, as in vLLM)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = dict(s.labels)
            assert labels.pop("model_name") == model_name, s
            samples[s.name, tuple(sorted(labels.items()))] = s.value
    return samples


def test_metrics_count_requests_tokens_and_latencies_under_vllms_names(checkpoints, tmp_path):
    s = harness.serve(checkpoints["untied"], tmp_path, "--block-size", "4",
                      "--num-kv-blocks", "512", "--metrics-port", "0")
    try:
        port = int(s.processes[0].wait_for_log(
            r"Prometheus metrics on http://[\d.]+:(\d+)/metrics").group(1))
        name = s.client.model_info().model_name
        before = scrape(port, name)
        assert before[("splitserve:dataplane_attached", ())] == 1
        assert before[("splitserve:num_kv_blocks", ())] == 512
        prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
        for prompt in prompts:
            assert s.client.generate(prompt, max_tokens=5, ignore_eos=True).completion_tokens == 5
        # a stop token id: the steps in flight behind it sampled tokens that are not output
        greedy = s.client.generate([12, 13], max_tokens=12, temperature=0, ignore_eos=True)
        stopped = s.client.generate([12, 13], max_tokens=12, temperature=0, ignore_eos=True,
                                    stop_token_ids=[greedy.token_ids[5]])
        assert stopped.finish_reason == "stop" and stopped.completion_tokens < 12
        middle = scrape(port, name)
        stream = s.client.generate_stream([10, 11], max_tokens=400, ignore_eos=True,
                                          request_id="cut")
        assert next(stream).token_ids
        assert s.client.abort("cut") == 1
        assert s.wait_idle()
        after = scrape(port, name)
    finally:
        s.stop()
    assert middle[("splitserve:generation_tokens_total", ())] == \
        3 * 5 + greedy.completion_tokens + stopped.completion_tokens
    assert middle[("splitserve:prompt_tokens_total", ())] == sum(map(len, prompts)) + 2 * 2
    success = lambda reason: after[("splitserve:request_success_total",  # noqa: E731
                                    (("finished_reason", reason),))]
    assert [success(r) for r in ("length", "stop", "abort", "error")] == [4, 1, 1, 0]
    assert after[("splitserve:prompt_tokens_total", ())] == sum(map(len, prompts)) + 3 * 2
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert after[(f"splitserve:{histogram}_count", ())] == 6
        assert after[(f"splitserve:{histogram}_sum", ())] > 0
    assert after[("splitserve:request_time_per_output_token_seconds_count", ())] >= 5
    assert after[("splitserve:num_requests_running", ())] == 0
    assert after[("splitserve:num_requests_waiting", ())] == 0
    assert after[("splitserve:kv_cache_usage_perc", ())] == 0
    steps = ("splitserve:engine_steps_total", ())
    assert after[steps] > before[steps]
