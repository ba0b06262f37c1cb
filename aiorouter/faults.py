"""Test-only fault injection: requests that fail on purpose, so that tests and the soak
(`bench/soak.py`) can show that a failure inside the runtime fails the requests it touches and
nothing else, and leaks nothing.

A `FaultPlan` maps a fault kind to a marker, a run of token ids that a prompt starts with. A request
whose prompt starts with kind K's marker meets fault K at the first step that samples its output
token number `after` (counting from 0), so a stream has some tokens out before it breaks:

- "step": the model step that samples for it raises (on whichever model that is);
- "nan": its row of logits is all NaN; "inf": its row gets a +inf (the rest of the batch is untouched);
- "route" / "send" / "receive": the policy's route (for the batch that holds the request), send or
  receive (for the request) raises;
- "kill": the model step that samples for it kills that model's subserver (`SubserverKilled`, which
  no per-request guard catches): a bug outside any request, so tests see the router fail every
  request at once, answer unhealthy, and restart the subserver (or give up and say so).

The plan wraps what the runtime calls, when the router is built with one
(`RouterConfig(faults=...)`, `aiorouter serve --inject-faults PLAN.json`): each model's step
function (`wrap_step`) and the policy (`wrap_policy`). The engine, the runner, the subserver and
the policy base class know nothing of it, and a router without a plan runs none of this code:
never in production.
The client that sent a marked request knows it meant it to fail, so tests and the soak tell the
failures they caused from the ones they did not.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, cast

import torch

from engines.runner import ForwardOutput, ScheduledSeq
from policies.base import PeerReq, Policy, ReqView, StepResult

STEP_KINDS = ("step", "nan", "inf", "kill")
POLICY_KINDS = ("route", "send", "receive")
KINDS = STEP_KINDS + POLICY_KINDS


class InjectedFault(RuntimeError):
    """A failure caused on purpose by a `FaultPlan`."""


class SubserverKilled(BaseException):
    """A subserver killed on purpose. A BaseException, as SystemExit is: the runtime fails a request
    for any Exception its serving raises and goes on, so only this gets past those guards and ends
    the subserver's task, as a bug in the runtime itself would."""


@dataclass(frozen=True)
class FaultPlan:
    markers: Mapping[str, tuple[int, ...]] = field(default_factory=dict)  # kind -> prompt prefix
    after: int = 2  # output tokens a marked request commits before its fault fires

    def __post_init__(self) -> None:
        markers = {}
        for kind, ids in dict(self.markers).items():
            if kind not in KINDS:
                raise ValueError(f"fault plan: unknown fault kind {kind!r}; kinds: {', '.join(KINDS)}")
            if not ids or any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in ids):
                raise ValueError(f"fault plan: the marker of {kind!r} must be a non-empty list of token ids, got {ids!r}")
            markers[kind] = tuple(ids)
        for a, ma in markers.items():
            for b, mb in markers.items():
                if a != b and mb[:len(ma)] == ma:
                    raise ValueError(f"fault plan: the marker of {a!r} starts the marker of {b!r}; "
                                     "a prompt must name one fault")
        if not isinstance(self.after, int) or self.after < 0:
            raise ValueError(f"fault plan: after must be an integer >= 0, got {self.after!r}")
        object.__setattr__(self, "markers", markers)

    @classmethod
    def load(cls, source: str | Path) -> "FaultPlan":
        """A plan from a JSON file: {"markers": {"step": [49100, 49101], ...}, "after": 2}."""
        path = Path(source)
        try:
            raw = json.loads(path.read_text())
        except OSError as e:
            raise ValueError(f"fault plan {str(path)!r}: {e.strerror}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"fault plan {str(path)!r} is not valid JSON: {e}") from None
        if not isinstance(raw, dict) or set(raw) - {"markers", "after"} or not isinstance(raw.get("markers"), dict):
            raise ValueError(f"fault plan {str(path)!r} must be an object with 'markers' (kind -> token ids) "
                             "and optionally 'after'")
        return cls(raw["markers"], raw.get("after", 2))

    def to_json(self) -> str:
        return json.dumps({"markers": {k: list(v) for k, v in self.markers.items()}, "after": self.after})

    def kind_of(self, token_ids: Sequence[int], num_prompt_tokens: int) -> str | None:
        """The fault a request meets now (its prompt's marker, once `after` tokens are out), or None."""
        if len(token_ids) - num_prompt_tokens < self.after:
            return None
        for kind, m in self.markers.items():
            if len(m) <= num_prompt_tokens and tuple(token_ids[:len(m)]) == m:
                return kind
        return None

    # -- the wrappers ------------------------------------------------------------------------------
    def wrap_step(self, step: Callable[..., ForwardOutput]) -> Callable[..., ForwardOutput]:
        """A model's step function (`Engine.execute`'s signature) that meets this plan's step faults."""
        def faulty_step(batch: list[ScheduledSeq], *args: Any, **kwargs: Any) -> ForwardOutput:
            out = step(batch, *args, **kwargs)
            with torch.inference_mode():  # the runner's logits are inference tensors
                return self._break(out)
        return faulty_step

    def _break(self, out: ForwardOutput) -> ForwardOutput:
        """The step's output as the plan breaks it. "step" and "kill" raise after the forward: a step
        that raises commits nothing (the engine's `finish` does not run), so its K/V are rewritten
        alike when it runs again. "nan"/"inf" write into the row's logits [B, rows] and mark the row
        bad, as the runner does for logits that broke by themselves."""
        bad = set(out.bad_rows)
        for row, seq in enumerate(out.seqs):
            kind = self.kind_of(seq.token_ids, seq.num_prompt_tokens)
            if kind == "step":
                raise InjectedFault("injected step fault: the model step raised (test-only fault plan)")
            if kind == "kill":
                raise SubserverKilled("injected kill: this model's subserver dies (test-only fault plan)")
            if kind == "nan":
                out.logits[row] = float("nan")
            elif kind == "inf":
                out.logits[row, seq.token_ids[-1] % out.logits.shape[-1]] = float("inf")
            if kind in ("nan", "inf"):
                bad.add(row)
        return out._replace(bad_rows=tuple(sorted(bad)))

    def wrap_policy(self, policy: Policy) -> Policy:
        """`policy` as the runtime calls it under this plan: route, send and receive raise for a
        request marked for them; everything else is the policy's own."""
        return cast(Policy, FaultyPolicy(policy, self))  # duck-typed: it answers as `policy` does

    def check(self, stage: str, reqs: Sequence[ReqView]) -> None:
        """Raise in `stage` when one of `reqs` is marked for it."""
        for r in reqs:
            if self.kind_of(r.token_ids, r.num_prompt_tokens) == stage:
                raise InjectedFault(f"injected {stage} fault for request {r.rid} (test-only fault plan)")


class FaultyPolicy:
    """A policy that meets a plan's faults first (`FaultPlan.wrap_policy`). Not a Policy subclass on
    purpose: the base class's defaults would shadow the wrapped policy's own methods and flags, so
    every attribute but route, send and receive is the wrapped policy's, read live."""

    def __init__(self, inner: Policy, plan: FaultPlan):
        self.inner, self.plan = inner, plan

    def __getattr__(self, name: str) -> Any:  # only for what this class does not define
        return getattr(self.inner, name)

    def route(self, result: StepResult):
        self.plan.check("route", result.reqs)
        return self.inner.route(result)

    def send(self, req: ReqView) -> PeerReq:
        self.plan.check("send", [req])
        return self.inner.send(req)

    def receive(self, peer_req: PeerReq, req: ReqView) -> list[int]:
        self.plan.check("receive", [req])
        return self.inner.receive(peer_req, req)
