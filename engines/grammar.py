"""Structured output: a request's response constrained to a JSON schema, any JSON object, a regex,
one of a list of strings, or a grammar (xgrammar's EBNF, or Lark's syntax as vLLM takes it),
through xgrammar.

The grammar's state belongs to the request, not to a model: it lives on the request's output
stream (engines/output.py), which every committed token goes through whichever model wrote it
(`Engine.commit`, and the router's `RequestTable.commit` for the tokens a policy's send carries),
so the matcher advances with each of them. Whichever model samples the request's next token reads
that state for its mask (`apply_grammar`, called by the sampler on the rows that ask).

A token the matcher refuses (one a policy's send commits that no model sampled under the mask)
fails that request with an error naming the token; the other requests go on. xgrammar is imported
when the first structured request arrives: a server that never sees one never loads it.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from engines.devices import host_tensor

# vLLM's `structured_outputs` keys, each one kind of constraint
KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutput:
    """One request's constraint. `kind`: one of KINDS; `spec`: the schema as JSON text (`json`),
    the regex, the choices as a JSON list, the EBNF grammar, or "" (`json_object`), kept as text so
    the parameters stay hashable and equal schemas share one compiled grammar. `where`: the request
    field it came from, named in the errors a bad one raises (a server's `response_format`, ...)."""

    kind: str
    spec: str = ""
    where: str = field(default="structured", compare=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"{self.where}: unknown structured output kind {self.kind!r}; use one of {', '.join(KINDS)}")
        if not isinstance(self.spec, str):
            raise ValueError(f"{self.where}: the {self.kind} constraint must be given as text here "
                             "(StructuredOutput.of builds one from a schema or a list)")
        if self.kind != "json_object" and not self.spec.strip():
            raise ValueError(f"{self.where}: the {self.kind} constraint is empty")

    @classmethod
    def of(cls, kind: str, value: Any = None, where: str | None = None) -> "StructuredOutput":
        """From a request's value: a JSON schema as a dict or JSON text (`json`), a regex or an
        EBNF grammar as text, a list of strings (`choice`); `json_object` takes none."""
        where = where or kind
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{where}: the JSON schema is not valid JSON: {e.msg}") from None
            if isinstance(value, bool):  # JSON Schema's true (anything) and false (nothing)
                raise ValueError(f"{where}: a boolean schema constrains nothing useful; give an object schema")
            if not isinstance(value, dict):
                raise ValueError(f"{where}: a JSON schema must be an object, got {type(value).__name__}")
            return cls(kind, json.dumps(value), where)  # key order kept: xgrammar writes properties in it
        if kind == "choice":
            if (not isinstance(value, (list, tuple)) or not value
                    or any(not isinstance(c, str) or not c for c in value)):
                raise ValueError(f"{where}: choices must be a non-empty list of non-empty strings, got {value!r}")
            return cls(kind, json.dumps(list(value)), where)
        if kind == "json_object":
            return cls(kind, "", where)
        if kind in ("regex", "grammar") and not isinstance(value, str):
            raise ValueError(f"{where}: the {kind} must be a string, got {type(value).__name__}")
        return cls(kind, value, where)

    @classmethod
    def from_mapping(cls, spec: Mapping[str, Any], where: str = "structured_outputs") -> "StructuredOutput":
        """vLLM's `structured_outputs` shape: exactly one of {"json": schema, "json_object": true,
        "regex": ..., "choice": [...], "grammar": ...}."""
        if not isinstance(spec, Mapping):
            raise ValueError(f"{where} must be an object such as {{\"json\": {{...}}}}, got {type(spec).__name__}")
        unknown = [k for k in spec if k not in KINDS]
        if unknown:
            raise ValueError(f"{where}.{unknown[0]}: not supported; give one of {', '.join(KINDS)}")
        given = [k for k in KINDS if spec.get(k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"{where}: give exactly one of {', '.join(KINDS)}, got "
                             f"{', '.join(given) if given else 'none'}")
        kind = given[0]
        return cls.of(kind, spec[kind], f"{where}.{kind}")


def _ebnf_literal(text: str) -> str:
    """`text` as an EBNF string literal: quotes, backslashes and control characters escaped."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


# xgrammar's errors start with a timestamp and its C++ source's place: the client needs the reason only
_XGR_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")


class Grammars:
    """The compiler of one tokenizer's grammars (a router's entry model's, or an engine's own).
    xgrammar's compiler caches each compiled grammar, so a schema many requests share is compiled
    once. Compiling takes milliseconds for the schemas requests send; a server compiles off its
    event loop (`compile` in a thread) before it submits, and the submit finds it cached."""

    def __init__(self, tokenizer: Any, eos_ids: Sequence[int]):
        """`eos_ids`: the tokens that end a response; the grammar allows them only where it accepts."""
        import xgrammar as xgr
        self.vocab_size = len(tokenizer)  # the tokenizer's ids; a model's padding rows past it are masked off
        self.eos_ids = tuple(eos_ids)
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                       stop_token_ids=list(self.eos_ids) or None)
        self.compiler = xgr.GrammarCompiler(self.info, cache_enabled=True)

    def compile(self, so: StructuredOutput) -> Any:
        """-> xgrammar's CompiledGrammar; ValueError naming the field for a schema, regex or
        grammar it cannot compile. JSON is compiled without free whitespace between tokens (a
        model could otherwise write spaces until max_tokens), as vLLM's `disable_any_whitespace`."""
        try:
            if so.kind == "json":
                return self.compiler.compile_json_schema(so.spec, any_whitespace=False)
            if so.kind == "json_object":
                return self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if so.kind == "regex":
                return self.compiler.compile_regex(so.spec)
            if so.kind == "choice":
                return self.compiler.compile_grammar("root ::= " + " | ".join(map(_ebnf_literal, json.loads(so.spec))))
            if "::=" not in so.spec:  # Lark's rule syntax (`start: ...`), which vLLM's grammar field takes too
                return self.compiler.compile_lark(so.spec)
            return self.compiler.compile_grammar(so.spec)
        except (RuntimeError, ValueError, TypeError) as e:
            reason = _XGR_PREFIX.sub("", str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
            raise ValueError(f"{so.where}: cannot compile this {so.kind} constraint: {reason}") from None

    def state(self, so: StructuredOutput) -> "GrammarState":
        """A fresh matcher for one request."""
        return GrammarState(self, so, self.compile(so))


class GrammarDeadEnd(ValueError):
    """The request's constraint allows no token of the vocabulary where it stands (a regex asking
    for characters no token writes, such as lone surrogates): it cannot be completed. The request
    asked for what cannot be done, so it fails as the client's fault (the server's 400)."""


class GrammarState:
    """One request's place in its grammar. `accept` runs where tokens commit (the event loop);
    `apply_grammar` reads it in a model's step. A request is computed by one model at a time (the
    others hold it parked), so no step reads it while a commit changes it."""

    def __init__(self, grammars: Grammars, so: StructuredOutput, compiled: Any):
        import xgrammar as xgr
        self.grammars, self.spec = grammars, so
        self.matcher = xgr.GrammarMatcher(compiled)
        self.vocab_size = grammars.vocab_size

    def accept(self, token: int) -> bool:
        """Advance over a committed token -> True when the response is complete: a stop token was
        accepted, or the grammar accepts what is written and allows nothing but a stop token next
        (a choice's last token: the response ends there, without a step that could only write EOS).
        A token the grammar refuses raises ValueError (its request fails)."""
        m = self.matcher
        if not m.accept_token(token):
            if not self._allowed().any():
                raise GrammarDeadEnd(f"the request's structured output ({self.spec.where}, {self.spec.kind}) "
                                     "allows no token of the vocabulary here: it cannot be completed")
            raise ValueError(f"token {token} does not follow the request's structured output "
                             f"({self.spec.where}, {self.spec.kind}): a model or a policy's send "
                             "committed a token the grammar does not allow here")
        return m.is_terminated() or (m.is_completed() and self._only_stops())

    def _allowed(self) -> np.ndarray:
        """The tokens the grammar allows next, as bits [ceil(V/32)] uint32 (unsigned: bit 31 is a
        token like any other)."""
        import xgrammar as xgr
        mask = xgr.allocate_token_bitmask(1, self.vocab_size)
        self.matcher.fill_next_token_bitmask(mask)
        return mask[0].numpy().view(np.uint32).copy()

    def _only_stops(self) -> bool:
        bits = self._allowed()
        for t in self.grammars.eos_ids:  # clear the stop tokens' bits: anything left is another token
            if t < self.vocab_size:
                bits[t // 32] &= np.uint32(0xFFFFFFFF ^ (1 << (t % 32)))
        return not bits.any()


def apply_grammar(logits: torch.Tensor, params: Sequence[Any], seqs: Sequence[Any] | None) -> torch.Tensor:
    """logits [B, V] -> the same with each constrained row's disallowed tokens at -inf, and every
    id past the tokenizer's vocabulary too (a model's padding rows are no tokens). `params`: the
    rows' SamplingParams (a row asks with `structured`); `seqs`: their sequences, whose output
    stream holds the request's `GrammarState`. Out of place, as `apply_controls` (the step's raw
    logits stay what policies and log probabilities read); the input itself when no row asks.
    Batched: one xgrammar fill of the rows' bitmasks (on the host, where the matchers are) and one
    apply over those rows on the logits' device."""
    rows = [i for i, p in enumerate(params) if p.structured is not None]
    if not rows:
        return logits
    states = [seqs[i].output.grammar if seqs is not None and seqs[i].output is not None else None for i in rows]
    if any(g is None for g in states):
        raise ValueError("a structured request's sequence has no grammar state (its output stream was made without one)")
    import xgrammar as xgr
    vocab = states[0].vocab_size
    if any(g.vocab_size != vocab for g in states):
        raise ValueError("one step's structured requests come from tokenizers of different sizes")
    mask = xgr.allocate_token_bitmask(len(rows), vocab)
    # one per call (6 us): steps of two models may fill at once, each from its own worker thread
    xgr.BatchGrammarMatcher().batch_fill_next_token_bitmask([g.matcher for g in states], mask)
    dev, V = logits.device, logits.shape[-1]
    idx = host_tensor(rows, torch.int64, dev)
    x = logits.index_select(0, idx)  # [R, V], a copy
    if dev.type == "cuda":
        mask = mask.pin_memory().to(dev, non_blocking=True)
    xgr.apply_token_bitmask_inplace(x, mask, vocab_size=min(V, vocab))
    if V > vocab:
        x[:, vocab:] = float("-inf")
    # A grammar can allow no token at all (a regex of characters no token writes): such a row left
    # all -inf makes softmax NaN and fails the whole step. Zeroed, it draws a placeholder, which its
    # matcher then refuses at commit, failing that request alone with an error naming the grammar.
    x = x.masked_fill(torch.isneginf(x).all(-1, keepdim=True), 0.0)
    return logits.index_copy(0, idx, x)
