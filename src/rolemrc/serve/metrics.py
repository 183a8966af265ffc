"""Prometheus metrics per model and restraint (one registry per app)."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from rolemrc.serve.engines.supervisor import STATES

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        labels = ("model", "restraint")
        self.requests = Counter("rolemrc_requests", "Completed requests", (*labels, "endpoint", "status"),
                                registry=self.registry)
        self.latency = Histogram("rolemrc_request_latency_seconds", "Request latency (admission to last byte)",
                                 (*labels, "endpoint"), buckets=LATENCY_BUCKETS, registry=self.registry)
        self.tokens = Counter("rolemrc_tokens", "Tokens processed", (*labels, "kind"), registry=self.registry)
        self.queue = Gauge("rolemrc_queue_depth", "Requests waiting for a batch slot", labels, registry=self.registry)
        self.running = Gauge("rolemrc_running", "Requests in a running batch", labels, registry=self.registry)
        self.inflight = Gauge("rolemrc_inflight", "Requests being handled", registry=self.registry)
        self.admitted = Gauge("rolemrc_admitted", "Engine requests admitted (waiting or generating), at most max_queue",
                              ("model",), registry=self.registry)
        self.restarts = Counter("rolemrc_engine_restarts", "Engine restarts after a crash", ("model",),
                                registry=self.registry)
        self.engine_state = Gauge("rolemrc_engine_state", "1 for the state each engine is in", ("model", "state"),
                                  registry=self.registry)
        self._seen: set[tuple[str, str]] = set()
        self._restarts: dict[str, int] = {}

    def observe(self, model: str, restraint: str, endpoint: str, status: int, latency: float,
                prompt_tokens: int = 0, completion_tokens: int = 0) -> None:
        self.requests.labels(model, restraint, endpoint, str(status)).inc()
        self.latency.labels(model, restraint, endpoint).observe(latency)
        if prompt_tokens:
            self.tokens.labels(model, restraint, "prompt").inc(prompt_tokens)
        if completion_tokens:
            self.tokens.labels(model, restraint, "completion").inc(completion_tokens)

    def render(self, engines: dict) -> tuple[bytes, str]:
        """Refresh the queue and engine gauges from the engines and render the exposition text."""
        depth = {(name, r): n for name, e in engines.items() for r, n in e.queue_depth().items()}
        running = {(name, r): n for name, e in engines.items() for r, n in e.running.items()}
        self._seen |= depth.keys() | running.keys()
        for key in self._seen:
            self.queue.labels(*key).set(depth.get(key, 0))
            self.running.labels(*key).set(running.get(key, 0))
        for name, engine in engines.items():
            self.admitted.labels(name).set(engine.admitted)
            current, _ = engine.health() if hasattr(engine, "health") else ("ok", None)
            for s in STATES:
                self.engine_state.labels(name, s).set(float(s == current))
            supervisor = getattr(engine, "supervisor", None)
            restarts = supervisor.restarts if supervisor is not None else 0
            self.restarts.labels(name).inc(restarts - self._restarts.get(name, 0))
            self._restarts[name] = restarts
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
