"""The engine's Prometheus metrics (GET /metrics, api.py): requests, prompt tokens by where their KV came from,
store hits per tier, time to first token and time in the queue (histograms), what waits now, and each tier below
the hot cache: what it holds (records, bytes, in its format: fp16 or cachegen) and what its reads have cost (records,
tokens and bytes read, seconds reading and seconds decoding: a CacheGen tier's decode is the price of its bytes)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

TTFT_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 30)


class Metrics:
    """The engine's Prometheus metrics, in a registry of their own (two apps in one process keep theirs apart).
    engine: anything whose load() says what waits (engine.Engine.load)."""

    def __init__(self, engine):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("l27_requests", "Requests served, by endpoint", ["endpoint"], registry=r)
        self.errors = Counter("l27_request_errors", "Requests refused or failed, by HTTP status", ["status"],
                              registry=r)
        self.prompt_tokens = Counter("l27_prompt_tokens", "Prompt tokens by where their KV came from: prefix (the "
                                     "store, exact), blended (reused chunks), recomputed (computed here)", ["source"],
                                     registry=r)
        self.generated = Counter("l27_generation_tokens", "Answer tokens generated", registry=r)
        self.hits = Counter("l27_store_hits", "KV records read from the store, by tier", ["tier"], registry=r)
        self.cancelled = Counter("l27_cancelled", "Answers stopped because the client went away", registry=r)
        self.ttft = Histogram("l27_ttft_seconds", "Time from a request's arrival to its first answer token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.queue = Histogram("l27_queue_seconds", "Time from a request's arrival to its first step (its KV looked up "
                               "and loaded, a place among the running requests)",
                               buckets=TTFT_BUCKETS, registry=r)
        Gauge("l27_running", "Requests being served at once (prefilling or decoding)", registry=r).set_function(
            lambda: engine.load()["running"])
        Gauge("l27_queued", "Requests waiting for their first step", registry=r).set_function(
            lambda: engine.load()["queued"])
        Gauge("l27_store_jobs", "Chunks waiting to be prefilled alone and records waiting to be written",
              registry=r).set_function(
            lambda: engine.load()["store_jobs"])

        r.register(Tiers(engine))

    def started(self, start: dict) -> None:
        """A request's "start" event (reuse, queue_s): its prompt tokens by source, its store hits, its time queued."""
        reuse = start["reuse"]
        for source in ("prefix", "blended", "recomputed"):
            self.prompt_tokens.labels(source).inc(getattr(reuse, source))
        for tier, n in reuse.hits.items():
            self.hits.labels(tier).inc(n)
        self.queue.observe(start["queue_s"])

    def ended(self, end: dict) -> None:
        """A request's "end" event (tokens, finish_reason), counted even for a client gone."""
        self.generated.inc(end["tokens"])
        if end["finish_reason"] == "cancelled":
            self.cancelled.inc()


class Tiers:
    """A collector of each tier's figures (engine.tiers(), read when /metrics is scraped, never by /health: a Redis
    tier's count scans its keys), labelled by tier and format."""

    HELD = (("l27_tier_records", "Records a tier holds"), ("l27_tier_bytes", "Bytes of records a tier holds"))
    READ = (("l27_tier_read_records", "Records read from a tier"), ("l27_tier_read_tokens", "Tokens of KV read"),
            ("l27_tier_read_bytes", "Bytes of records read"), ("l27_tier_read_seconds", "Seconds reading records"),
            ("l27_tier_decode_seconds", "Seconds decoding records read (FP16 to float32, or CacheGen's bitstream)"))

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        stats = getattr(self.engine, "tiers", lambda: [])()
        families = [GaugeMetricFamily(n, h, labels=["tier", "format"]) for n, h in self.HELD] + \
            [CounterMetricFamily(n, h, labels=["tier", "format"]) for n, h in self.READ]
        for tier, fmt, *values in stats:
            for family, value in zip(families, values):
                family.add_metric([tier, fmt], value)
        yield from families
