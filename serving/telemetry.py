"""Recording into serving/metrics.py's definitions: per-request timings at the ingress, engine stats from replicas.

One Prometheus endpoint per pod: the ingress owns the registry. Every request passes through it, so request
counters and latency histograms are recorded there as chunks stream by. Engine gauges live in the replicas
(other processes, maybe other pods); each replica reports them every stats_interval_s (LLMServer.stats), and
`EngineStatsAggregator` sums them over the replicas heard from recently.
"""

from __future__ import annotations

import time
from typing import Callable

from cpuserve.serving.metrics import ServingMetrics, initialize_serving_metrics
from cpuserve.serving.protocol import Chunk, ModelInfo, ReplicaStats

STALE_AFTER_S = 10.0  # a replica silent this long is gone (restarted or scaled down)


class RequestMetrics:
    """One model's per-request metrics, each labelled child looked up once (a lookup costs about what an
    observation does, and a streamed message makes several)."""

    def __init__(self, metrics: ServingMetrics, model: str):
        self.metrics = metrics
        self.model = model
        self.queue_time = metrics.request_queue_time.labels(model=model)
        self.time_to_first_token = metrics.time_to_first_token.labels(model=model)
        self.inter_token_latency = metrics.inter_token_latency.labels(model=model)
        self.e2e_request_latency = metrics.e2e_request_latency.labels(model=model)
        self.prompt_tokens = metrics.prompt_tokens.labels(model=model)
        self.generation_tokens = metrics.generation_tokens.labels(model=model)


class RequestTimer:
    """Times one request from its arrival at the ingress; feed it every chunk, then `finish` once.

    Args:
        metrics_of: a model's RequestMetrics (EngineStatsAggregator.request_metrics).
        model: the model the request is counted under until its first chunk names the model that serves it.
    """

    def __init__(self, metrics_of: Callable[[str], RequestMetrics], model: str):
        self.metrics_of = metrics_of
        self.metrics = metrics_of(model)
        self.arrival = time.perf_counter()
        self.last_token_time: float | None = None
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.finished = False

    def on_chunk(self, chunk: Chunk) -> None:
        now = time.perf_counter()
        if chunk.model and chunk.model != self.metrics.model:  # the first chunk names the model that serves it
            self.metrics = self.metrics_of(chunk.model)
        m = self.metrics
        num_new = len(chunk.ids)
        if chunk.queue_time is not None:
            m.queue_time.observe(chunk.queue_time)
        if num_new:
            if self.last_token_time is None:  # first token(s): TTFT; tokens arriving with it had no gap
                m.time_to_first_token.observe(now - self.arrival)
                num_gaps, gap = num_new - 1, 0.0
            else:  # several tokens in one message share the gap evenly
                num_gaps, gap = num_new, (now - self.last_token_time) / num_new
            for _ in range(num_gaps):
                m.inter_token_latency.observe(gap)
            self.last_token_time = now
        self.prompt_tokens = chunk.prompt_tokens
        self.completion_tokens = chunk.completion_tokens

    def finish(self, finish_reason: str) -> None:
        """Count the request once, by finish reason (stop, length, abort, error)."""
        if self.finished:
            return
        self.finished = True
        m = self.metrics
        m.metrics.requests.labels(model=m.model, finish_reason=finish_reason).inc()
        m.prompt_tokens.inc(self.prompt_tokens)
        m.generation_tokens.inc(self.completion_tokens)
        m.e2e_request_latency.observe(time.perf_counter() - self.arrival)


class EngineStatsAggregator:
    """Sums the replicas' engine gauges per served model; turns their step times and preemption and draft totals
    into increments; knows which models the replicas serve (two while a model change rolls).

    The gauges are computed when they are scraped, over the replicas heard from in the last STALE_AFTER_S: a
    replica that stops reporting (gone, or its reports lost) drops out even when no other replica reports. Each
    model's series are created at zero the first time a replica reports it (or at start for `model`, the config's:
    None for an ingress that learns it from the reports).
    """

    def __init__(self, metrics: ServingMetrics, model: str | None, clock: Callable[[], float] = time.monotonic):
        self.metrics = metrics
        self.clock = clock
        self._latest: dict[str, tuple[float, ReplicaStats]] = {}  # replica_id -> (clock time, its latest report)
        self._totals: dict[tuple[str, str], int] = {}  # (replica_id, counter) -> its total so far (kept while silent)
        self._watched: dict[str, RequestMetrics] = {}
        if model:
            self.watch(model)

    def request_metrics(self, model: str) -> RequestMetrics:
        """`model`'s per-request metrics (its series watched from now on)."""
        self.watch(model)
        return self._watched[model]

    def watch(self, model: str) -> None:
        """Create `model`'s series at zero and compute its gauges at each scrape (once per model)."""
        if model in self._watched:
            return
        m = self.metrics
        initialize_serving_metrics(m, model)
        self._watched[model] = RequestMetrics(m, model)
        # called by the Prometheus endpoint's thread at each scrape
        m.num_requests_running.labels(model=model).set_function(lambda: self._sum(model, "num_running"))
        m.num_requests_waiting.labels(model=model).set_function(lambda: self._sum(model, "num_waiting"))
        m.kv_cache_usage_ratio.labels(model=model).set_function(lambda: self._kv_usage(model))

    def update(self, stats: ReplicaStats) -> None:
        m, model, replica = self.metrics, stats.model.name, stats.replica_id
        self.watch(model)
        step = m.engine_step.labels(model=model, rank="0")
        for seconds in stats.step_times:
            step.observe(seconds)
        for key, total, counter in (("preemptions", stats.num_preemptions, m.preemptions),
                                    ("draft", stats.num_draft_tokens, m.spec_draft_tokens),
                                    ("accepted", stats.num_accepted_tokens, m.spec_accepted_tokens)):
            delta = total - self._totals.get((replica, key), 0)  # replica totals -> increments
            self._totals[(replica, key)] = total
            if delta > 0:
                counter.labels(model=model).inc(delta)
        now = self.clock()
        live = {r: v for r, v in self._latest.items() if now - v[0] < STALE_AFTER_S}
        live[replica] = (now, stats)
        self._latest = live  # one assignment: the scrape thread reads either dict whole

    def models(self) -> dict[str, ModelInfo]:
        """name -> info of the models live replicas serve, the most recently reported model first."""
        out: dict[str, ModelInfo] = {}
        for _, stats in sorted(self._live_reports(), key=lambda v: v[0], reverse=True):
            out.setdefault(stats.model.name, stats.model)
        return out

    def _live_reports(self) -> list[tuple[float, ReplicaStats]]:
        now = self.clock()
        return [v for v in self._latest.values() if now - v[0] < STALE_AFTER_S]

    def _live(self, model: str | None = None) -> list[ReplicaStats]:
        return [s for _, s in self._live_reports() if model is None or s.model.name == model]

    def _sum(self, model: str, key: str) -> float:
        return float(sum(getattr(s, key) for s in self._live(model)))

    def _kv_usage(self, model: str) -> float:
        live = self._live(model)
        blocks = sum(s.num_blocks for s in live)
        return sum(s.num_used_blocks for s in live) / blocks if blocks else 0.0

    @property
    def num_replicas(self) -> int:
        return len(self._live())
