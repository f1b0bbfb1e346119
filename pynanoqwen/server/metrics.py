"""What /metrics reports, in Prometheus' text format (prometheus_client), one registry per server.

Latencies are measured in the engine's worker thread:
- time to first token, from the moment the route took the request (so it includes reading,
  checking and tokenizing it, the queue and the prefill);
- time to start, from that moment to the engine taking the job up (the same less the prefill);
- inter-token latency, between consecutive tokens of one generation;
- cancellation latency, from the cancel (a client gone, or a newer /infill) to the engine being free.

The prefix-cache figures are read from the cache's own counters when scraped; hit rate = prompt
tokens served from cached pages / prompt tokens.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..prefix_cache import PrefixCache

TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)
CANCEL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class _PrefixCacheCollector:
    def __init__(self, cache: PrefixCache):
        self.cache = cache

    def collect(self):
        stats = self.cache.stats
        yield CounterMetricFamily("pynanoqwen_prefix_cache_lookup_tokens",
                                  "Prompt tokens looked up in the prefix cache", value=stats.prompt_tokens)
        yield CounterMetricFamily("pynanoqwen_prefix_cache_hit_tokens",
                                  "Prompt tokens whose KV came from cached pages", value=stats.hit_tokens)
        yield GaugeMetricFamily("pynanoqwen_prefix_cache_hit_rate", "hit_tokens / lookup_tokens since the start",
                                value=stats.hit_rate)
        yield GaugeMetricFamily("pynanoqwen_prefix_cache_pages", "KV pages held by the prefix cache",
                                value=self.cache.cached_pages)
        yield CounterMetricFamily("pynanoqwen_prefix_cache_evicted_pages", "Cached pages overwritten by later requests",
                                  value=stats.evicted_pages)


class Metrics:
    def __init__(self, cache: PrefixCache | None):
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("pynanoqwen_requests", "HTTP requests answered", ["endpoint", "status"],
                                registry=registry)
        self.prompt_tokens = Counter("pynanoqwen_prompt_tokens", "Prompt tokens of the generations run",
                                     registry=registry)
        self.generated_tokens = Counter("pynanoqwen_generated_tokens", "Tokens generated", registry=registry)
        self.lookup_drafted = Counter("pynanoqwen_prompt_lookup_drafted_tokens",
                                      "Tokens prompt lookup proposed (serve --prompt-lookup)", registry=registry)
        self.lookup_accepted = Counter("pynanoqwen_prompt_lookup_accepted_tokens",
                                       "Of the drafted tokens, those the model agreed with", registry=registry)
        self.time_to_first_token = Histogram("pynanoqwen_time_to_first_token_seconds",
                                             "From a request's arrival to its first generated token",
                                             buckets=TTFT_BUCKETS, registry=registry)
        self.time_to_start = Histogram("pynanoqwen_time_to_start_seconds",
                                       "From a request's arrival to the engine starting it (reading, checking and "
                                       "tokenizing it, then the queue)", buckets=TTFT_BUCKETS, registry=registry)
        self.inter_token_latency = Histogram("pynanoqwen_inter_token_latency_seconds",
                                             "Between consecutive tokens of a generation", buckets=ITL_BUCKETS,
                                             registry=registry)
        self.cancelled = Counter("pynanoqwen_cancelled_requests", "Requests stopped before they finished",
                                 ["reason"], registry=registry)
        self.cancel_latency = Histogram("pynanoqwen_cancel_latency_seconds",
                                        "From a running request's cancellation to the engine being free",
                                        buckets=CANCEL_BUCKETS, registry=registry)
        self.queued = Gauge("pynanoqwen_queued_requests", "Requests waiting for the engine", registry=registry)
        if cache is not None:
            registry.register(_PrefixCacheCollector(cache))

    def render(self) -> bytes:
        return generate_latest(self.registry)
