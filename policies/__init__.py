"""Routing algorithms written as route/send/receive for one request."""
from __future__ import annotations

import inspect
from typing import Any

from policies.base import STAY, PeerReq, Policy, ReqView, RouteInput, SinglePolicy
from policies.citer import CITERPolicy
from policies.colm import CoLLMPolicy
from policies.ensemble import EnsemblePolicy
from policies.query import QueryPolicy
from policies.r2r import R2RPolicy
from policies.random_policy import RandomPolicy
from policies.rstitch import RStitchPolicy

REGISTRY: dict[str, type[Policy]] = {p.name: p for p in (SinglePolicy, RandomPolicy, RStitchPolicy, R2RPolicy,
                                                         CITERPolicy, CoLLMPolicy, EnsemblePolicy, QueryPolicy)}


def register(cls: type[Policy]) -> type[Policy]:
    REGISTRY[cls.name] = cls
    return cls


def make_policy(policy: str | Policy, args: dict[str, Any] | None = None) -> Policy:
    if isinstance(policy, Policy):
        if args:
            raise ValueError("policy_args apply to a policy given by name, not to a Policy instance")
        return policy
    if policy not in REGISTRY:
        raise ValueError(f"unknown policy {policy!r}; registered: {', '.join(sorted(REGISTRY))}")
    cls = REGISTRY[policy]
    args = dict(args or {})
    params = inspect.signature(cls.__init__).parameters
    unknown = [k for k in args if k not in params]
    if unknown:
        allowed = [k for k in params if k != "self"]
        raise ValueError(f"policy {policy!r} has no argument {unknown[0]!r}; it takes: {', '.join(allowed) or 'none'}")
    return cls(**args)


__all__ = ["STAY", "PeerReq", "Policy", "ReqView", "RouteInput", "REGISTRY", "register", "make_policy",
           "SinglePolicy", "RandomPolicy", "RStitchPolicy", "R2RPolicy", "CITERPolicy", "CoLLMPolicy",
           "EnsemblePolicy", "QueryPolicy"]
