"""`RouterConfig`: how a router serves its models, one frozen value. The CLI (`aiorouter serve`,
`generate`) and Ray replicas build one; `Router(models, config)` reads it and never changes it, so
one config may build several routers."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Mapping

from aiorouter.faults import FaultPlan
from aiorouter.launch import MODES
from policies import Policy


@dataclass(frozen=True)
class RouterConfig:
    # the routing policy: a registered name (policies.make_policy) built with `policy_args`, or an instance
    policy: str | Policy = "single"
    policy_args: Mapping[str, Any] | None = None
    entry: str | None = None  # the model that receives requests and tokenizes prompts (None: the first)
    device: str = "cpu"  # of every model whose ModelSpec names none
    # when each model launches a step: delayed batching, eager (async), step-sync (aiorouter.launch)
    mode: Literal["delayed", "eager", "sync"] = "delayed"
    # delayed batching's B per model: "auto" (the throughput model solves them), a dict model -> B,
    # or a dict N -> {model: B}
    thresholds: object = "auto"
    max_concurrency: int = 64  # requests decoded at once (the tuner solves up to this N)
    max_wait_ms: float | None = None  # delayed: launch below the threshold after this long
    kv_memory_gb: float = 2.0  # KV cache memory, split between the models
    tune_concurrency: int | None = None  # solve the schedule up to this N (None: max_concurrency)
    # CPU intra-op threads per model worker: None plans by weight, an int for every model, a dict by name
    threads: int | Mapping[str, int] | None = None
    # thresholds="auto": re-solve the schedule while serving when the routing or the served step
    # times drift from what it was solved for (in a child process at idle priority; still ~10-15 %
    # of throughput while it runs on a 2-core CPU host, docs/throughput-model.md). False keeps the
    # start-up schedule.
    retune: bool = True
    # test-only: requests that fail on purpose (aiorouter/faults.py); never in production
    faults: FaultPlan | None = None
    # A request's failure fails that request alone; a model's subserver task that dies anyway (a
    # bug outside any request) fails every request the router holds at once and is restarted with a
    # fresh engine state after `restart_delay_s`, doubled for each restart before it in the last 10
    # minutes (a crash loop backs off, as supervisors do). After `max_restarts` restarts in 10
    # minutes it stays down: `Router.dead` says why and `wait_dead()` returns (`aiorouter serve`
    # then exits with status 1, for its supervisor to restart).
    max_restarts: int = 3
    restart_delay_s: float = 0.5

    def __post_init__(self) -> None:
        """What can be checked without the models; the router checks the names (entry, thresholds,
        threads) against its models."""
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; use one of {', '.join(MODES)}")
        if not isinstance(self.retune, bool):
            raise ValueError(f"retune must be True or False, got {self.retune!r}")
        if isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise ValueError(f"max_restarts must be an integer >= 0, got {self.max_restarts!r}")
        if not isinstance(self.restart_delay_s, (int, float)) or not 0 <= self.restart_delay_s < float("inf"):
            raise ValueError(f"restart_delay_s must be a finite number >= 0, got {self.restart_delay_s!r}")
        if isinstance(self.max_concurrency, bool) or not isinstance(self.max_concurrency, int) \
                or self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be an integer >= 1, got {self.max_concurrency!r}")
        if self.faults is not None and not isinstance(self.faults, FaultPlan):
            raise ValueError(f"faults must be a FaultPlan or None, got {type(self.faults).__name__}")

    @property
    def max_wait_s(self) -> float | None:
        return self.max_wait_ms / 1000 if self.max_wait_ms else None
