"""Pick rstitch's entropy threshold so that a real pair actually splits its tokens.

With a fixed tau (the policy's default 0.03) the smollm2 pair never routes: the 10-layer small
model is unsure of every token on these prompts, and the large model of nearly every one, so
each token costs a small step and a large step. Here both models decode a few of the
workload's prompts greedily, their normalised entropies are recorded, and tau is the value at
which the two-state chain of rstitch (small hands off when H_small > tau, large hands back when
H_large <= tau) spends `large_share` of its steps on the large model, as `random` does on
cpu-tiny (p = 0.35).
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch

from engines import Engine, SamplingParams
from policies.rstitch import normalized_entropy


def entropies(path: str | Path, prompts: list[list[int]], steps: int) -> np.ndarray:
    """Normalised next-token entropies along each prompt's greedy continuation."""
    eng = Engine.from_pretrained(path, num_kv_tokens=4096)
    out: list[float] = []
    seqs = [eng.add_request(p, SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)) for p in prompts]
    with torch.inference_mode():
        while not all(s.is_finished for s in seqs):
            step = eng.forward()
            out += normalized_entropy(step.logits).tolist()
            for s, t in zip(step.seqs, step.next_tokens):
                eng.append_token(s, t)
    return np.asarray(out)


def large_share(tau: float, h_small: np.ndarray, h_large: np.ndarray) -> float:
    """Stationary share of large-model steps: p / (p + q), p = P(H_small > tau), q = P(H_large <= tau)."""
    p, q = float((h_small > tau).mean()), float((h_large <= tau).mean())
    return p / (p + q) if p + q > 0 else 0.0


def _checkpoint_id(path: str | Path) -> list:
    """What identifies a checkpoint's weights without reading them: its files' names, sizes, mtimes."""
    files = [(f.name, f.stat()) for f in Path(path).iterdir() if f.is_file()]
    return sorted((name, st.st_size, st.st_mtime_ns) for name, st in files)


def calibrate(small: str | Path, large: str | Path, prompts: list[list[int]], target: float = 0.35,
              steps: int = 32, cache: Path | None = None) -> dict:
    """-> {"tau", "large_share" (predicted), "target", "tokens"}: the candidate closest to the target.
    With `cache` (a folder), a result is kept there under a hash of both checkpoints' files and
    every argument, and reused: the calibration decodes with both models (seconds per invocation)."""
    entry = None
    if cache is not None:
        key = json.dumps([_checkpoint_id(small), _checkpoint_id(large), prompts, target, steps])
        entry = Path(cache) / f"tau-{hashlib.sha256(key.encode()).hexdigest()[:20]}.json"
        if entry.is_file():
            return json.loads(entry.read_text())
    h_small, h_large = entropies(small, prompts, steps), entropies(large, prompts, steps)
    candidates = np.unique(np.concatenate([h_small, h_large]))
    shares = np.array([large_share(t, h_small, h_large) for t in candidates])
    best = int(np.argmin(np.abs(shares - target)))
    out = {"tau": round(float(candidates[best]), 6), "large_share": round(float(shares[best]), 3),
           "target": target, "tokens": int(h_small.size)}
    if entry is not None:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = entry.with_name(f"{entry.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(out))
        tmp.replace(entry)  # a concurrent reader sees the whole file or none
    return out
