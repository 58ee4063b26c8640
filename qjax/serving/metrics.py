"""Prometheus metrics of a running server (``GET /metrics``), with vLLM's metric names under a ``qjax:`` prefix.

Each server owns its registry (no process-global collectors): two servers in one process, or a server restarted by
a test, never share counts.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from .engine import EngineMetricsSink

CONTENT_TYPE = CONTENT_TYPE_LATEST
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)


class ServerMetrics(EngineMetricsSink):
    """The engine's reports as Prometheus series (labelled with the served model name)."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name"]
        self._running = Gauge("qjax:num_requests_running", "Requests holding a sequence slot.", labels, registry=r)
        self._waiting = Gauge("qjax:num_requests_waiting", "Requests waiting for a slot.", labels, registry=r)
        self._prompt = Counter("qjax:prompt_tokens", "Prompt tokens prefilled.", labels, registry=r)
        self._generated = Counter("qjax:generation_tokens", "Tokens generated.", labels, registry=r)
        self._ttft = Histogram("qjax:time_to_first_token_seconds", "Arrival to first generated token.", labels,
                               buckets=_LATENCY_BUCKETS, registry=r)
        self._itl = Histogram("qjax:inter_token_latency_seconds", "Time between a request's generated tokens.",
                              labels, buckets=_LATENCY_BUCKETS, registry=r)
        self._e2e = Histogram("qjax:e2e_request_latency_seconds", "Arrival to the last token.", labels,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self._done = Counter("qjax:request_success", "Finished requests by finish reason.",
                             ["model_name", "finished_reason"], registry=r)
        # speculative decoding, as vLLM counts it: mean accepted length = 1 + accepted / drafts rounds; acceptance at
        # draft position j = accepted_per_pos{position=j} / drafts
        self._spec_drafts = Counter("qjax:spec_decode_num_drafts", "Verify rounds of a sequence (one per row).",
                                    labels, registry=r)
        self._spec_draft_tokens = Counter("qjax:spec_decode_num_draft_tokens", "Draft tokens verified.", labels,
                                          registry=r)
        self._spec_accepted = Counter("qjax:spec_decode_num_accepted_tokens", "Draft tokens accepted.", labels,
                                      registry=r)
        self._spec_per_pos = Counter("qjax:spec_decode_num_accepted_tokens_per_pos",
                                     "Draft tokens accepted at each draft position (0 = the first draft).",
                                     ["model_name", "position"], registry=r)
        self._name = model_name
        self.queue(0, 0)

    def queue(self, running: int, waiting: int) -> None:
        self._running.labels(self._name).set(running)
        self._waiting.labels(self._name).set(waiting)

    def prompt_tokens(self, n: int) -> None:
        self._prompt.labels(self._name).inc(n)

    def generated_tokens(self, n: int) -> None:
        self._generated.labels(self._name).inc(n)

    def first_token(self, seconds: float) -> None:
        self._ttft.labels(self._name).observe(seconds)

    def inter_token(self, seconds: float, n: int) -> None:
        h = self._itl.labels(self._name)
        for _ in range(n):
            h.observe(seconds)

    def finished(self, reason: str, seconds: float) -> None:
        self._done.labels(self._name, reason).inc()
        self._e2e.labels(self._name).observe(seconds)

    def speculated(self, drafts: int, accepted: int) -> None:
        self._spec_drafts.labels(self._name).inc()
        self._spec_draft_tokens.labels(self._name).inc(drafts)
        self._spec_accepted.labels(self._name).inc(accepted)
        for j in range(drafts):
            self._spec_per_pos.labels(self._name, str(j)).inc(1 if j < accepted else 0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
