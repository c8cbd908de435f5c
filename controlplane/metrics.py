"""Prometheus metrics of the engine, under vLLM's names with `splitserve:` for `vllm:`, so that
dashboards and alerts written for vLLM carry over: served over HTTP at `/metrics` when
`--metrics-port` is given (`serve_metrics`).

Per-request figures (time to first token, end-to-end latency, time per output token, how
requests ended) are observed by the engine as requests pass those points (`RequestMetrics`);
everything else is read from the engine when Prometheus scrapes (`EngineCollector`), so that
the per-step path pays nothing for it.
"""

import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from common.errors import ConfigError
from controlplane.request import FinishReason, Request

if TYPE_CHECKING:  # (the engine imports this module)
    from controlplane.engine import Engine

PREFIX = "splitserve:"
# request_success_total's finished_reason: vLLM's values where it has the case (EOS and stop
# strings or ids are all "stop" there)
_REASON_LABELS = {FinishReason.LENGTH: "length", FinishReason.EOS: "stop",
                  FinishReason.STOP: "stop", FinishReason.ABORTED: "abort",
                  FinishReason.ERROR: "error", FinishReason.UNAVAILABLE: "unavailable",
                  FinishReason.SHUTDOWN: "shutdown"}
# vLLM's buckets for these histograms
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class RequestMetrics:
    """What the engine observes of each request: its first token, its end, and the tokens it
    admits and produces (plain integers: one addition per request or per step)."""

    def __init__(self) -> None:
        self.ttft = Histogram(f"{PREFIX}time_to_first_token_seconds",
                              "Time from arrival to the first output token", registry=None,
                              buckets=_TTFT_BUCKETS)
        self.e2e = Histogram(f"{PREFIX}e2e_request_latency_seconds",
                             "Time from arrival to the end of the request", registry=None,
                             buckets=_E2E_BUCKETS)
        self.tpot = Histogram(f"{PREFIX}request_time_per_output_token_seconds",
                              "A request's mean time per output token after its first",
                              registry=None, buckets=_TPOT_BUCKETS)
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.reason_to_count = {label: 0 for label in _REASON_LABELS.values()}

    def admitted(self, request: Request) -> None:
        self.num_prompt_tokens += request.num_prompt_tokens

    def first_token(self, request: Request) -> None:
        request.first_token_time = time.monotonic()
        self.ttft.observe(request.first_token_time - request.arrival_time)

    def finished(self, request: Request, reason: FinishReason) -> None:
        now = time.monotonic()
        self.reason_to_count[_REASON_LABELS[reason]] += 1
        self.e2e.observe(now - request.arrival_time)
        first = request.first_token_time
        if first is not None and request.num_output_tokens > 1:
            self.tpot.observe((now - first) / (request.num_output_tokens - 1))


class EngineCollector(Collector):
    """The engine's state and counters, read at each scrape, every metric labelled with the
    model's name as vLLM's are (dashboards filter on model_name). (Reads of ints and lengths,
    safe from the HTTP server's thread: nothing here iterates a structure the loop changes.)"""

    def __init__(self, engine: "Engine", model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        e = self.engine
        m = e.metrics
        running, waiting, used, total = e.load()
        for kind, name, documentation, value in (
                (GaugeMetricFamily, "num_requests_running", "Requests in the running set", running),
                (GaugeMetricFamily, "num_requests_waiting", "Requests waiting to be scheduled",
                 waiting),
                (GaugeMetricFamily, "kv_cache_usage_perc",
                 "Fraction of the KV cache's blocks in use (0-1)", used / total if total else 0.0),
                (GaugeMetricFamily, "num_kv_blocks",
                 "KV cache blocks the attached data plane holds", total),
                (GaugeMetricFamily, "dataplane_attached", "1 while a data plane is attached",
                 int(e.is_attached)),
                (CounterMetricFamily, "prompt_tokens", "Prompt tokens of admitted requests",
                 m.num_prompt_tokens),
                (CounterMetricFamily, "generation_tokens", "Output tokens of requests",
                 m.num_generation_tokens),
                (CounterMetricFamily, "num_preemptions", "Requests preempted (recomputed later)",
                 e.num_preemptions),
                (CounterMetricFamily, "dataplane_losses", "Data planes lost",
                 e.num_dataplane_losses),
                (CounterMetricFamily, "engine_steps", "Steps the data plane answered",
                 e.num_steps)):
            family = kind(f"{PREFIX}{name}", documentation, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
        success = CounterMetricFamily(f"{PREFIX}request_success", "Requests ended, by how",
                                      labels=["model_name", "finished_reason"])
        for label, count in m.reason_to_count.items():
            success.add_metric([self.model_name, label], count)
        yield success
        for histogram in (m.ttft, m.e2e, m.tpot):
            for family in histogram.collect():
                family.samples = [sample._replace(labels={"model_name": self.model_name,
                                                          **sample.labels})
                                  for sample in family.samples]
                yield family


def serve_metrics(engine: "Engine", model_name: str, host: str, port: int
                  ) -> tuple[WSGIServer, threading.Thread, int]:
    """Serve the engine's metrics at http://host:port/metrics from a thread (prometheus_client's
    own server). Returns the server (`shutdown()` stops it), its thread and the bound port."""
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine, model_name))
    try:  # (the host as gRPC takes it: "[::]" too)
        server, thread = start_http_server(port, addr=host.strip("[]"), registry=registry)
    except OSError as e:
        raise ConfigError(f"--metrics-port {port} of {host}: {e.strerror or e}") from None
    return server, thread, server.server_port
