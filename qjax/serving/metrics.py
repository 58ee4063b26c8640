"""Prometheus metrics of a running server (``GET /metrics``): vLLM's metric names, each under both prefixes —
``vllm:`` (what vLLM's dashboards and autoscalers read: a drop-in) and ``qjax:`` (the names earlier releases wrote).

Each metric is declared once (:data:`METRICS`) and registered under both prefixes. Each server owns its registry (no
process-global collectors): two servers in one process, or a server restarted by a test, never share counts.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from .engine import EngineMetricsSink

CONTENT_TYPE = CONTENT_TYPE_LATEST
PREFIXES = ("vllm", "qjax")
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)

# attribute → (kind, vLLM's name, help, extra labels beside model_name); counters get prometheus' ``_total``
METRICS = {
    "running": (Gauge, "num_requests_running", "Requests holding a sequence slot.", ()),
    "waiting": (Gauge, "num_requests_waiting", "Requests waiting for a slot.", ()),
    "kv_usage": (Gauge, "kv_cache_usage_perc", "Share of the K/V cache slots the requests in their rows use (0-1).",
                 ()),
    "prompt": (Counter, "prompt_tokens", "Prompt tokens prefilled.", ()),
    "generated": (Counter, "generation_tokens", "Tokens generated.", ()),
    "ttft": (Histogram, "time_to_first_token_seconds", "Arrival to first generated token.", ()),
    "itl": (Histogram, "inter_token_latency_seconds", "Time between a request's generated tokens.", ()),
    "e2e": (Histogram, "e2e_request_latency_seconds", "Arrival to the last token.", ()),
    "done": (Counter, "request_success", "Finished requests by finish reason.", ("finished_reason",)),
    # speculative decoding, as vLLM counts it: mean accepted length = 1 + accepted / drafts rounds; acceptance at
    # draft position j = accepted_per_pos{position=j} / drafts
    "spec_drafts": (Counter, "spec_decode_num_drafts", "Verify rounds of a sequence (one per row).", ()),
    "spec_draft_tokens": (Counter, "spec_decode_num_draft_tokens", "Draft tokens verified.", ()),
    "spec_accepted": (Counter, "spec_decode_num_accepted_tokens", "Draft tokens accepted.", ()),
    "spec_per_pos": (Counter, "spec_decode_num_accepted_tokens_per_pos",
                     "Draft tokens accepted at each draft position (0 = the first draft).", ("position",)),
}


class _Both:
    """One metric under every prefix: ``labels(...)`` gives a child whose updates go to each."""

    def __init__(self, collectors):
        self.collectors = collectors

    def labels(self, *values):
        return _Both([c.labels(*values) for c in self.collectors])

    def __getattr__(self, method):  # inc / set / observe
        def apply(*args):
            for c in self.collectors:
                getattr(c, method)(*args)
        return apply


class ServerMetrics(EngineMetricsSink):
    """The engine's reports as Prometheus series (labelled with the served model name)."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        for attr, (kind, name, text, extra) in METRICS.items():
            kw = {"buckets": _LATENCY_BUCKETS} if kind is Histogram else {}
            setattr(self, "_" + attr, _Both([kind(f"{p}:{name}", text, ["model_name", *extra], registry=self.registry,
                                                  **kw) for p in PREFIXES]))
        self._name = model_name
        self.queue(0, 0)
        self.kv_cache(0.0)

    def queue(self, running: int, waiting: int) -> None:
        self._running.labels(self._name).set(running)
        self._waiting.labels(self._name).set(waiting)

    def kv_cache(self, used: float) -> None:
        self._kv_usage.labels(self._name).set(used)

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
