"""Prometheus metrics of the front end (`--metrics-port`), named as operators know them from
vLLM (`blink:` where vLLM has `vllm:`).

Latencies are measured here, per request, as the client sees them minus the network: time to
first token, inter-token latency (per streamed chunk, divided over its tokens; the tokens
that came with the first have none, as vLLM observes none for a first token), end-to-end
latency. Prompt tokens count once a request's first token came (its prefill done, as vLLM
counts them). Finishes are counted by vLLM's reasons as the client got them: "stop" (a stop
string, stop token or EOS; a stop string although the front end stops the engine's sequence
with a cancel) or "length". The engine's gauges and
counters are read from the ring header at scrape time; its counters are summed over engine
restarts (EngineLink.counter_totals), so they never go down.
"""
from __future__ import annotations

import socket
import threading
import time
from wsgiref.simple_server import WSGIRequestHandler

from prometheus_client import CollectorRegistry, Counter, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import ThreadingWSGIServer

from blink.nic_service.engine_link import EngineLink

# seconds: from a millisecond (a decode step) to minutes (a long prompt behind a queue)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56,
                   5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0, 1280.0, 2560.0, 7680.0)
# the proto's finish reasons (lower case) as vLLM's metric labels
FINISHED_LABELS = {"eos": "stop", "stop": "stop", "length": "length"}
ITL_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075,
               0.1, 0.2, 0.5, 1.0, 2.5)


def metrics_socket_address(host: str, port: int) -> tuple[int, tuple]:
    """The family and socket address that the metrics endpoint binds for `host` and `port`:
    getaddrinfo's first, as prometheus_client picks them. Raises OSError (a name unknown)."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                  flags=socket.AI_PASSIVE)[0]
    return family, address


class QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):
        """Nothing: wsgiref writes a line to stderr per request (a scrape every few seconds)."""


class MetricsServer(ThreadingWSGIServer):
    """prometheus_client's metrics server (start_http_server's: a thread per scrape). With
    reuse_port, bound with SO_REUSEPORT where the system has it (start_http_server leaves it
    unset): so that it binds beside the socket by which serve holds a worker's port for as long
    as serve runs (client.cli._check_metrics_ports; it does not listen, so it takes no
    connections). Without, a port another listener holds is refused, as it should be."""

    def __init__(self, host: str, port: int, registry: CollectorRegistry,
                 reuse_port: bool = False):
        self.address_family, address = metrics_socket_address(host, port)
        self.reuse_port = reuse_port
        super().__init__(address, QuietHandler)
        self.set_app(make_wsgi_app(registry))

    def server_bind(self):
        if self.reuse_port and hasattr(socket, "SO_REUSEPORT"):  # (allow_reuse_port: 3.11+)
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        super().server_bind()


def start_metrics_server(port: int, host: str, registry: CollectorRegistry,
                         reuse_port: bool = False) -> MetricsServer:
    """A MetricsServer serving `registry` from a daemon thread; raises OSError."""
    server = MetricsServer(host, port, registry, reuse_port)
    threading.Thread(target=server.serve_forever, name="blink-metrics", daemon=True).start()
    return server


class EngineCollector:
    """Engine state at scrape time, from the front end's link to the ring: this process's view
    (liveness, its slots and queue) and, where engine_wide, the engine's own gauges and
    counters, which one worker of several exports (each exporting them, a sum over the workers'
    targets would count every token once a worker)."""

    def __init__(self, link: EngineLink, engine_wide: bool = True):
        self.link, self.engine_wide = link, engine_wide

    def collect(self):
        link = self.link
        yield GaugeMetricFamily("blink:engine_alive", "1 while the engine's heartbeat moves",
                                value=1.0 if link.alive else 0.0)
        age = link.heartbeat_age()
        yield GaugeMetricFamily("blink:engine_heartbeat_age_seconds",
                                "seconds since the engine's heartbeat last moved",
                                value=age if age is not None else float("nan"))
        yield CounterMetricFamily("blink:engine_attachments",
                                  "times the front end attached to an engine (restarts + 1)",
                                  value=link.attachments)
        yield GaugeMetricFamily("blink:ring_slots_in_use", "request slots holding a request",
                                value=link.slots_in_use)
        yield GaugeMetricFamily("blink:num_requests_queued",
                                "requests waiting in the front end for a free slot",
                                value=link.waiting_for_slot)
        if not self.engine_wide:
            return
        h = link.header_snapshot()
        if h is not None and link.info is not None:
            for name, field, text in (
                    ("blink:num_requests_running", "sequences_running", "sequences scheduled"),
                    ("blink:num_requests_waiting", "sequences_waiting",
                     "sequences admitted by the engine, waiting to be scheduled"),
                    ("blink:kv_cache_blocks_total", "kv_blocks_total", "KV-cache blocks"),
                    ("blink:kv_cache_blocks_free", "kv_blocks_free",
                     "free KV-cache blocks (evictable prefix-cache blocks too)"),
                    ("blink:kv_cache_blocks_cached", "kv_blocks_cached",
                     "full KV-cache blocks kept in the prefix cache, in use or not")):
                yield GaugeMetricFamily(name, text, value=int(h[field]))
            total = int(h["kv_blocks_total"])
            yield GaugeMetricFamily("blink:kv_cache_usage_perc", "KV-cache blocks in use, 0-1",
                                    value=(total - int(h["kv_blocks_free"])) / total
                                    if total else 0.0)
        totals = link.counter_totals()
        for name, field, text in (
                ("blink:num_preemptions", "preemptions", "sequences preempted (recomputed)"),
                ("blink:generation_tokens", "tokens_generated",
                 "tokens the engine generated (with the few a stop string's stream had "
                 "generated past its stop before the engine saw the cancel)"),
                ("blink:engine_steps", "engine_steps", "engine steps that ran a forward pass"),
                ("blink:engine_step_tokens", "step_tokens",
                 "tokens those steps computed (prefill chunks + decodes)"),
                ("blink:requests_rejected_by_engine", "requests_rejected",
                 "requests the engine refused (bad slots)"),
                # in tokens, as vLLM's: hits / queries is the prefix cache's hit rate
                ("blink:prefix_cache_queries", "prefix_query_tokens",
                 "tokens of admitted requests looked up in the prefix cache (their first "
                 "admission: a preempted request's recompute is not a query)"),
                ("blink:prefix_cache_hits", "prefix_hit_tokens",
                 "of those, tokens found in the prefix cache (prefill skipped)"),
                ("blink:prefix_cache_evicted_blocks", "prefix_evicted_blocks",
                 "prefix-cache blocks evicted to make room")):
            yield CounterMetricFamily(name, text, value=totals[field])
        yield CounterMetricFamily("blink:engine_busy_seconds",
                                  "seconds the engine spent in steps with a forward pass",
                                  value=totals["busy_ns"] / 1e9)


class FrontendMetrics:
    def __init__(self, link: EngineLink, engine_wide: bool = True):
        self.registry = CollectorRegistry()
        self.ttft = Histogram("blink:time_to_first_token_seconds",
                              "request received to first token streamed", registry=self.registry,
                              buckets=LATENCY_BUCKETS)
        self.itl = Histogram("blink:inter_token_latency_seconds",
                             "gap between streamed tokens", registry=self.registry,
                             buckets=ITL_BUCKETS)
        self.e2e = Histogram("blink:e2e_request_latency_seconds",
                             "request received to its final message", registry=self.registry,
                             buckets=LATENCY_BUCKETS)
        self.finished = Counter("blink:request_success", "requests finished, by reason",
                                ["finished_reason"], registry=self.registry)
        for label in set(FINISHED_LABELS.values()):  # at 0 from the start, as vLLM's
            self.finished.labels(label)
        self.failed = Counter("blink:request_failure", "requests ended with an error status",
                              ["code"], registry=self.registry)
        self.prompt_tokens = Counter("blink:prompt_tokens",
                                     "prompt tokens of requests that had their first token",
                                     registry=self.registry)
        self.registry.register(EngineCollector(link, engine_wide))

    def serve(self, port: int, host: str, reuse_port: bool = False) -> int:
        return start_metrics_server(port, host, self.registry, reuse_port).server_port


class RequestClock:
    """One request's timing for the metrics: first token, the gaps after it, the end; and
    how many tokens it streamed, and whether its end was counted (finished or failed)."""

    def __init__(self, metrics: FrontendMetrics | None, received: float):
        self.metrics, self.received = metrics, received
        self.first: float | None = None  # monotonic time of the first token
        self.last: float | None = None
        self.generated = 0
        self.prompt_tokens = 0  # counted in the metrics with the first token
        self.ended = False
        self.budget: float | None = None  # the call's deadline as it arrived, s (None: none)

    def tokens(self, n: int) -> None:
        if not n:
            return
        self.generated += n
        now = time.monotonic()
        if self.metrics is not None:
            if self.last is None:  # the first token; the rest of its chunk came with it, at
                # gaps the front end did not see (no gap rather than a false 0)
                self.metrics.ttft.observe(now - self.received)
                self.metrics.prompt_tokens.inc(self.prompt_tokens)
                gaps = []
            else:
                gaps = [(now - self.last) / n] * n
            for gap in gaps:  # one inter-token gap per token after the first
                self.metrics.itl.observe(gap)
        self.first = self.first or now
        self.last = now

    def finished(self, reason: str) -> None:
        self.ended = True
        if self.metrics is not None:
            self.metrics.e2e.observe(time.monotonic() - self.received)
            self.metrics.finished.labels(FINISHED_LABELS.get(reason, reason)).inc()

    def failed(self, code: str) -> None:
        self.ended = True
        if self.metrics is not None:
            self.metrics.failed.labels(code).inc()
