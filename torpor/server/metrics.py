"""Prometheus metrics of one server (its own registry, so several servers can share a process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
SLEEP_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
MEMORY_KINDS = ("reserved", "resident", "offloaded", "discarded", "allocated")
PAUSE_SCOPES = ("new", "all")  # pause_generation: no new request starts / nothing runs


class Metrics:
    """HTTP requests, tokens, request latency; sleeps and wakes; per-tag memory, the sleep level, the pause and
    the queue, read from the engine at every scrape."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.http_requests = Counter("torpor_http_requests", "HTTP requests by route and status code",
                                     ["route", "status"], registry=r)
        self.prompt_tokens = Counter("torpor_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("torpor_generation_tokens", "tokens generated", registry=r)
        self.request_latency = Histogram("torpor_request_latency_seconds", "arrival to last token",
                                         ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.sleeps = Counter("torpor_sleeps", "sleep calls that changed the level", ["level"], registry=r)
        self.wakes = Counter("torpor_wakes", "wake_up calls", registry=r)
        self.sleep_seconds = Histogram("torpor_sleep_seconds", "sleep duration (drain included)",
                                       buckets=SLEEP_BUCKETS, registry=r)
        self.wake_seconds = Histogram("torpor_wake_seconds", "wake_up duration", buckets=SLEEP_BUCKETS, registry=r)
        self.memory_bytes = Gauge("torpor_memory_bytes", "bytes of each memory tag by kind", ["tag", "kind"],
                                  registry=r)
        self.tag_asleep = Gauge("torpor_tag_asleep", "1 while the tag sleeps", ["tag"], registry=r)
        self.sleep_level = Gauge("torpor_sleep_level", "the engine's sleep level (-1: awake; 0 scheduling paused, "
                                 "1-4 memory released)", registry=r)
        self.paused = Gauge("torpor_generation_paused", "1 while generation is paused (pause_generation), by scope: "
                            "new (no new request starts) or all (nothing runs); their sum: paused at all",
                            ["scope"], registry=r)
        self.serving = Gauge("torpor_serving", "1 while the engine serves requests", registry=r)
        self.device_used = Gauge("torpor_device_used_bytes", "device memory in use", registry=r)
        self.num_running = Gauge("torpor_num_requests_running", "requests in the running batch", registry=r)
        self.num_waiting = Gauge("torpor_num_requests_waiting", "requests queued (asleep or no room)", registry=r)
        self.prefix_cache_queries = Gauge("torpor_prefix_cache_queries", "prompt tokens looked up in the prefix "
                                          "cache since start-up", registry=r)
        self.prefix_cache_hits = Gauge("torpor_prefix_cache_hits", "prompt tokens found in the prefix cache "
                                       "since start-up", registry=r)
        self.prefix_cache_hit_rate = Gauge("torpor_prefix_cache_hit_rate", "hits / queries since start-up",
                                           registry=r)

    def observe_request(self, endpoint: str, seconds: float, num_prompt_tokens: int, num_output_tokens: int) -> None:
        self.request_latency.labels(endpoint).observe(seconds)
        self.prompt_tokens.inc(num_prompt_tokens)
        self.generation_tokens.inc(num_output_tokens)

    def update_engine(self, stats: dict) -> None:
        """Gauges from `AsyncEngine.stats()`."""
        self.num_running.set(stats["num_running"])
        self.num_waiting.set(stats["num_waiting"])
        self.serving.set(int(stats["serving"]))
        self.sleep_level.set(-1 if stats["sleep_level"] is None else stats["sleep_level"])
        for scope in PAUSE_SCOPES:
            self.paused.labels(scope).set(int(stats["paused"] == scope))
        prefix_cache = stats.get("prefix_cache")
        if prefix_cache is not None:
            self.prefix_cache_queries.set(prefix_cache["queries"])
            self.prefix_cache_hits.set(prefix_cache["hits"])
            self.prefix_cache_hit_rate.set(prefix_cache["hits"] / max(1, prefix_cache["queries"]))
        memory = stats["memory"]
        if memory is None:
            return
        if memory["device_used_bytes"] is not None:
            self.device_used.set(memory["device_used_bytes"])
        for tag, usage in memory["tags"].items():
            for kind in MEMORY_KINDS:
                self.memory_bytes.labels(tag, kind).set(usage[f"{kind}_bytes"])
            self.tag_asleep.labels(tag).set(int(usage["state"] == "asleep"))

    def render(self) -> bytes:
        return generate_latest(self.registry)
