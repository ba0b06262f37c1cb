"""Routing algorithms written as route/send/receive for one request."""
from __future__ import annotations

import inspect
import typing
from types import MappingProxyType
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, create_model

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


class PolicyArgumentError(ValueError):
    """A policy argument that does not fit the policy's constructor; `field` names it."""

    def __init__(self, policy: str, field: str | None, reason: str, message: str | None = None):
        super().__init__(message or (f"policy {policy!r} argument {field}: {reason}" if field else
                                     f"policy {policy!r}: {reason}"))
        self.policy, self.field, self.reason = policy, field, reason


def argument_schema(cls: type[Policy]) -> type[BaseModel]:
    """A policy's arguments as a pydantic model, read from its constructor's signature: the type
    hints are the schema (a `float` must be a finite number, a `Literal` one of its values), so a
    client's per-request override is checked before anything is built, and every error names its
    argument. Types pydantic does not know (a router network, a tensor) are checked by isinstance."""
    hints = typing.get_type_hints(cls.__init__, include_extras=True)
    fields: dict[str, Any] = {}
    extra = "forbid"
    for name, p in inspect.signature(cls.__init__).parameters.items():
        if name == "self" or p.kind is p.VAR_POSITIONAL:
            continue
        if p.kind is p.VAR_KEYWORD:
            extra = "allow"
            continue
        fields[name] = (hints.get(name, Any), ... if p.default is p.empty else p.default)
    config = ConfigDict(arbitrary_types_allowed=True, allow_inf_nan=False, extra=extra)
    return create_model(f"{cls.__name__}Args", __config__=config, **fields)


def make_policy(policy: str | type[Policy] | Policy, args: dict[str, Any] | None = None) -> Policy:
    """A policy from a built-in name or a Policy class (with `args`), or a Policy instance as is.
    Bad arguments raise `PolicyArgumentError` (a ValueError) naming the argument."""
    if isinstance(policy, Policy):
        if args:
            raise ValueError("policy_args apply to a policy given by name or class, not to a Policy instance")
        return policy
    if isinstance(policy, type) and issubclass(policy, Policy):
        cls = policy
    elif isinstance(policy, str) and policy in BUILTIN:
        cls = BUILTIN[policy]
    else:
        raise ValueError(f"unknown policy {policy!r}; built in: {', '.join(sorted(BUILTIN))}, or pass a Policy")
    if not isinstance(args, (dict, type(None))):
        raise ValueError(f"policy_args must be a dict of argument -> value, got {type(args).__name__}")
    args = dict(args or {})
    params = inspect.signature(cls.__init__).parameters
    unknown = [k for k in args if k not in params]
    if unknown and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        allowed = [k for k in params if k != "self"]
        takes = f"it takes: {', '.join(allowed) or 'none'}"
        raise PolicyArgumentError(cls.name, str(unknown[0]), f"no such argument; {takes}",
                                  f"policy {policy!r} has no argument {unknown[0]!r}; {takes}")
    try:
        checked = argument_schema(cls).model_validate(args)
    except ValidationError as e:
        err = e.errors()[0]
        # the argument, then list indices; a union's member tags ("list[float]") are pydantic's, not the user's
        loc = err["loc"]
        where = ".".join([str(loc[0])] + [str(x) for x in loc[1:] if isinstance(x, int)]) if loc else None
        raise PolicyArgumentError(cls.name, where, err["msg"]) from None
    # the validated values of the arguments given (a "0.5" read as 0.5); the rest keep the constructor's defaults
    return cls(**{k: getattr(checked, k) if k in type(checked).model_fields else v for k, v in args.items()})


__all__ = ["STAY", "ModelInfo", "PeerReq", "Policy", "ReqView", "StepResult", "SmallLargePolicy", "BUILTIN",
           "make_policy", "argument_schema", "PolicyArgumentError", "SinglePolicy", "RandomPolicy", "RStitchPolicy", "R2RPolicy", "CITERPolicy", "CoLLMPolicy",
           "EnsemblePolicy", "QueryPolicy"]
