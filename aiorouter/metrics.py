"""Counters the runtime keeps; the server exports them (Prometheus) and benchmarks read them."""
from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from aiorouter.tuning.learned import StepSpan

SPANS_KEPT = 2000  # per model: the last this many forwards' spans (aiorouter.tuning.learned)


@dataclass
class ModelMetrics:
    tokens_committed: int = 0
    steps: int = 0
    batch_sizes: Counter = field(default_factory=Counter)  # batch size -> number of steps
    admission_delay_sum: float = 0.0  # seconds between becoming ready and joining a launched batch
    admission_delay_count: int = 0
    step_time_sum: float = 0.0
    # the runtime's cost per step beyond the forward itself (see Subserver.step), over `timed_steps`
    loop_time_sum: float = 0.0  # the event loop's work for the step, before and after the worker runs it
    hop_time_sum: float = 0.0  # the hop to the worker thread and back
    timed_steps: int = 0
    # when the worker ran each recent forward, and what it computed: with the other models' spans,
    # how much the models slowed each other while serving
    spans: deque = field(default_factory=lambda: deque(maxlen=SPANS_KEPT))
    kv_pages_total: int = 0

    def record_step(self, batch_size: int, seconds: float) -> None:
        self.steps += 1
        self.batch_sizes[batch_size] += 1
        self.step_time_sum += seconds

    def record_overhead(self, loop_seconds: float, hop_seconds: float) -> None:
        self.loop_time_sum += loop_seconds
        self.hop_time_sum += hop_seconds
        self.timed_steps += 1

    def record_span(self, span: StepSpan) -> None:
        self.spans.append(span)

    def record_admission(self, delay: float) -> None:
        self.admission_delay_sum += delay
        self.admission_delay_count += 1

    @property
    def mean_admission_delay(self) -> float:
        return self.admission_delay_sum / max(1, self.admission_delay_count)

    @property
    def mean_overhead(self) -> tuple[float, float]:
        """(loop, hop) seconds per step, mean over the timed steps."""
        n = max(1, self.timed_steps)
        return self.loop_time_sum / n, self.hop_time_sum / n

    @property
    def mean_batch_size(self) -> float:
        n = sum(self.batch_sizes.values())
        return sum(b * c for b, c in self.batch_sizes.items()) / max(1, n)


@dataclass
class RouterMetrics:
    models: dict[str, ModelMetrics]
    handoffs: Counter = field(default_factory=Counter)  # (src name, dst name) -> count
    requests_started: int = 0
    requests_finished: Counter = field(default_factory=Counter)  # finish reason -> count
    requests_failed: int = 0
    active: int = 0
    subserver_restarts: Counter = field(default_factory=Counter)  # model name -> restarts after its task died

    @property
    def tokens_committed(self) -> int:
        return sum(m.tokens_committed for m in self.models.values())
