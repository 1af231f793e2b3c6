"""Prometheus export of the engine's metrics (the server's GET /metrics)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxserve.core.router import Router
from jaxserve.engine.llm_engine import LLMEngine

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                    120.0)


class _RouterCollector:
    """Per data-parallel replica: requests routed there (and of them, for a cached prefix),
    and those in flight, read from the router when /metrics is scraped."""

    def __init__(self, router: Router):
        self.router = router

    def collect(self):
        routed = CounterMetricFamily("jaxserve_replica_requests_routed",
                                     "Requests the router sent to each replica", labels=["replica"])
        prefix = CounterMetricFamily("jaxserve_replica_requests_prefix_routed",
                                     "Requests sent to a replica for the prefix it caches",
                                     labels=["replica"])
        live = GaugeMetricFamily("jaxserve_replica_requests_in_flight",
                                 "Requests routed to each replica and not finished",
                                 labels=["replica"])
        for i, load in enumerate(self.router.loads):
            routed.add_metric([str(i)], load.routed)
            prefix.add_metric([str(i)], load.prefix_routed)
            live.add_metric([str(i)], load.in_flight)
        yield from (routed, prefix, live)


class PrometheusExporter:
    """Own registry per server; `update` runs on a replica's engine thread after each of its
    steps. Engine figures are summed over the data-parallel replicas; the router's
    per-replica counts carry a `replica` label."""

    def __init__(self, router: Router):
        r = self.registry = CollectorRegistry()
        r.register(_RouterCollector(router))
        self.running = Gauge("jaxserve_num_requests_running", "Requests in the running set",
                             registry=r)
        self.waiting = Gauge("jaxserve_num_requests_waiting", "Requests waiting", registry=r)
        self.held = Gauge("jaxserve_num_requests_held", "Requests prefilled beyond the decode "
                          "slots, holding their KV blocks until one frees", registry=r)
        self.swapped = Gauge("jaxserve_num_requests_swapped", "Requests swapped to host",
                             registry=r)
        self.kv_usage = Gauge("jaxserve_kv_cache_usage_ratio", "Fraction of KV blocks in use",
                              registry=r)
        self.kv_used = Gauge("jaxserve_kv_blocks_used", "KV blocks in use", registry=r)
        self.preemptions = Counter("jaxserve_preemptions", "Preemptions", registry=r)
        self.rejections = Counter("jaxserve_rejections", "Requests refused at admission",
                                  registry=r)
        self.prompt_tokens = Counter("jaxserve_prompt_tokens", "Prompt tokens computed",
                                     registry=r)
        self.generation_tokens = Counter("jaxserve_generation_tokens", "Tokens generated",
                                         registry=r)
        self.finished = Counter("jaxserve_requests_finished", "Finished requests",
                                ["finish_reason"], registry=r)
        self.ttft = Histogram("jaxserve_time_to_first_token_seconds", "TTFT",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("jaxserve_time_per_output_token_seconds", "TPOT",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("jaxserve_e2e_request_latency_seconds", "End-to-end latency",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.step = Histogram("jaxserve_step_duration_seconds", "Engine step duration",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.prefix_queries = Counter("jaxserve_prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache", registry=r)
        self.prefix_hits = Counter("jaxserve_prefix_cache_hits",
                                   "Prompt tokens found computed in the prefix cache", registry=r)
        self.prefix_host_hits = Counter(
            "jaxserve_prefix_cache_host_hits",
            "Prompt tokens found in the prefix cache's host tier (part of the hits)", registry=r)
        self.prefix_evictions = Counter("jaxserve_prefix_cache_evictions",
                                        "Cached blocks evicted for other contents", registry=r)
        self.prefix_host_evictions = Counter(
            "jaxserve_prefix_cache_host_evictions", "Host-tier blocks evicted for other contents",
            registry=r)
        self.prefix_blocks = Gauge("jaxserve_prefix_cache_blocks", "Blocks in the prefix cache",
                                   registry=r)
        self.prefix_host_blocks = Gauge("jaxserve_prefix_cache_host_blocks",
                                        "Blocks in the prefix cache's host tier", registry=r)
        self.spec_proposed = Counter("jaxserve_spec_decode_num_draft_tokens",
                                     "Tokens proposed by speculative decoding", registry=r)
        self.spec_accepted = Counter("jaxserve_spec_decode_num_accepted_tokens",
                                     "Proposed tokens the target model accepted", registry=r)
        self.spec_steps = Counter("jaxserve_spec_decode_num_steps",
                                  "Steps that verified proposals", registry=r)
        self._counters = (("num_preemptions", self.preemptions),
                          ("num_rejections", self.rejections),
                          ("prompt_tokens", self.prompt_tokens),
                          ("generation_tokens", self.generation_tokens),
                          ("prefix_cache_queries", self.prefix_queries),
                          ("prefix_cache_hits", self.prefix_hits),
                          ("prefix_cache_host_hits", self.prefix_host_hits),
                          ("prefix_cache_evictions", self.prefix_evictions),
                          ("prefix_cache_host_evictions", self.prefix_host_evictions),
                          ("spec_proposed_tokens", self.spec_proposed),
                          ("spec_accepted_tokens", self.spec_accepted),
                          ("spec_steps", self.spec_steps))
        self._gauges = (("num_running", self.running), ("num_waiting", self.waiting),
                        ("num_held", self.held),
                        ("num_swapped", self.swapped), ("kv_blocks_used", self.kv_used),
                        ("prefix_cache_blocks", self.prefix_blocks),
                        ("prefix_cache_host_blocks", self.prefix_host_blocks))
        self._seen: dict[int, dict[str, int]] = {}  # per replica: counters already exported
        self._last: dict[int, dict] = {}  # per replica: its latest snapshot

    def update(self, engine: LLMEngine, outputs=None, replica: int = 0) -> None:
        snap = self._last[replica] = engine.metrics_snapshot()
        snaps = list(self._last.values())
        for key, gauge in self._gauges:
            gauge.set(sum(s[key] for s in snaps))
        self.kv_usage.set(sum(s["kv_blocks_used"] for s in snaps)
                          / sum(s["kv_blocks_total"] for s in snaps))
        seen = self._seen.setdefault(replica, dict.fromkeys(
            [key for key, _ in self._counters] + ["num_requests_finished", "num_steps"], 0))
        for key, counter in self._counters:
            delta = snap[key] - seen[key]
            if delta > 0:
                counter.inc(delta)
            seen[key] = snap[key]
        m = engine.metrics
        new = snap["num_requests_finished"] - seen["num_requests_finished"]
        seen["num_requests_finished"] = snap["num_requests_finished"]
        for stats in m.finished[-new:] if new > 0 else []:
            self.finished.labels(stats.finish_reason or "unknown").inc()
            if stats.ttft is not None:
                self.ttft.observe(stats.ttft)
            if stats.tpot is not None:
                self.tpot.observe(stats.tpot)
            if stats.e2e is not None:
                self.e2e.observe(stats.e2e)
        steps = snap["num_steps"] - seen["num_steps"]
        seen["num_steps"] = snap["num_steps"]
        for d in m.step_durations[-steps:] if steps > 0 else []:
            self.step.observe(d)

    def render(self) -> bytes:
        return generate_latest(self.registry)
