"""Routing algorithms written as route/send/receive for one request."""
from __future__ import annotations

import inspect
from types import MappingProxyType
from typing import Any

from policies.base import STAY, ModelInfo, PeerReq, Policy, ReqView, SinglePolicy, SmallLargePolicy, StepResult
from policies.citer import CITERPolicy
from policies.colm import CoLLMPolicy
from policies.ensemble import EnsemblePolicy
from policies.query import QueryPolicy
from policies.r2r import R2RPolicy
from policies.random_policy import RandomPolicy
from policies.rstitch import RStitchPolicy

# The built-in policies by name (read-only: a process may hold several routers; your own policy is
# passed as an instance or a class, never registered globally).
BUILTIN: MappingProxyType[str, type[Policy]] = MappingProxyType({p.name: p for p in (
    SinglePolicy, RandomPolicy, RStitchPolicy, R2RPolicy, CITERPolicy, CoLLMPolicy, EnsemblePolicy, QueryPolicy)})


def make_policy(policy: str | type[Policy] | Policy, args: dict[str, Any] | None = None) -> Policy:
    """A policy from a built-in name or a Policy class (with `args`), or a Policy instance as is."""
    if isinstance(policy, Policy):
        if args:
            raise ValueError("policy_args apply to a policy given by name or class, not to a Policy instance")
        return policy
    if isinstance(policy, type) and issubclass(policy, Policy):
        cls = policy
    elif policy in BUILTIN:
        cls = BUILTIN[policy]
    else:
        raise ValueError(f"unknown policy {policy!r}; built in: {', '.join(sorted(BUILTIN))}, or pass a Policy")
    args = dict(args or {})
    params = inspect.signature(cls.__init__).parameters
    unknown = [k for k in args if k not in params]
    if unknown:
        allowed = [k for k in params if k != "self"]
        raise ValueError(f"policy {policy!r} has no argument {unknown[0]!r}; it takes: {', '.join(allowed) or 'none'}")
    return cls(**args)


__all__ = ["STAY", "ModelInfo", "PeerReq", "Policy", "ReqView", "StepResult", "SmallLargePolicy", "BUILTIN",
           "make_policy", "SinglePolicy", "RandomPolicy", "RStitchPolicy", "R2RPolicy", "CITERPolicy", "CoLLMPolicy",
           "EnsemblePolicy", "QueryPolicy"]
