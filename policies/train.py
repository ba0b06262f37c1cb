"""Train an R2R, CITER or Co-LLM router from a small and a large model (CPU-sized, but the real recipe).

    aiorouter train-router --policy r2r|citer|colm --small PATH --large PATH --prompts FILE.jsonl --out ROUTER.pt

1. The large model writes greedy responses (`engines.Engine`, batched).
2. The small model prefills prompt + response (HF transformers on the same directory) and records,
   at every response position, its final-normed hidden state, top-k logits and greedy token.
3. Label a position 1 (divergent) where the small model's token differs from the large model's.
   `verify_continuation=K` (R2R's refinement, with a token-level check in place of R2R's LLM
   verifier): continue both branches K tokens greedily with the large model and keep the label 1
   only if they do not re-join, i.e. their last max(1, K // 4) tokens differ under every shift of
   up to 2 tokens between the branches.
4. Train with class-balanced BCE; on held-out prompts pick the threshold with the lowest routed
   fraction whose recall of divergent positions is >= `recall` (default 0.95).
5. Save as the authors do (`policies.checkpoints.save_router`): R2R's official dict, recording the
   small model as `pretrained_model_name`; CITER's bare ConfidenceModel state dict (CITER's own
   token_route.py loads it), its threshold and figures in `<out>.json`.

Co-LLM (`colm`): trains only the deferral row, a vector w on the frozen small model's final-normed
hidden state (P(defer) = sigmoid(w . h), no bias, as an output-head row has none), initialized as
Co-LLM initializes its new row (the mean of the output head's rows). `--out` gets {"weight", "bias",
"eta", ...}; `--write-model DIR` also writes the small model with w as its (V+1)-th output row, the
layout Co-LLM saves and `policy="colm"` serves without a head file. How this differs from Co-LLM's
own training: Co-LLM fine-tunes the whole small model (or QLoRA) on a dataset's gold responses,
deferral and language modelling together (its marginal-likelihood loss, or BCE + LM loss), with
weak labels "the large model gives the gold token a higher probability than the small one", after
an initial BCE fit of the row alone; and it picks the threshold by Youden's J on an ROC curve.
Here the small model is untouched, the target is the large model's own greedy response, the label
is "their greedy tokens differ" (as for R2R and CITER), and the threshold meets a recall target.

Prompt file: JSON lines, each {"prompt": "text" | [token ids]} or {"messages": [...]} (chat
template), or a bare JSON string / list of token ids.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn

from policies.checkpoints import load_embedding, load_output_head, save_router, write_deferral_model
from policies.networks import CITERRouter, R2RRouter


class DeferralRow(nn.Module):
    """Co-LLM's deferral row, trained alone: the logit w . h on a final-normed hidden state [B, H] -> [B, 1]."""

    def __init__(self, init: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(init.detach().float().clone())

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return (hidden @ self.weight)[:, None]


# -- data ----------------------------------------------------------------------------------------
def read_prompts(prompts: str | Path | Sequence[Any]) -> list[Any]:
    if isinstance(prompts, (str, Path)):
        path = Path(prompts)
        if not path.is_file():
            raise FileNotFoundError(f"prompt file {str(path)!r} does not exist")
        items = []
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                try:
                    items.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: not valid JSON: {e}") from None
        prompts = items
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, dict):
            p = p.get("messages", p.get("prompt", p.get("prompt_token_ids", p.get("token_ids"))))
        if not p:
            raise ValueError(f"prompt {i}: expected text, token ids or {{'prompt'|'messages': ...}}, got {p!r}")
        out.append(p)
    if not out:
        raise ValueError("no prompts to train on")
    return out


def _tokenize(engine, p: Any) -> list[int]:
    if isinstance(p, list) and p and isinstance(p[0], dict):
        if engine.tokenizer is None or not getattr(engine.tokenizer, "chat_template", None):
            raise ValueError("chat-message prompts need a tokenizer with a chat template in the large model dir")
        ids = engine.tokenizer.apply_chat_template(p, add_generation_prompt=True)
        return list(ids if isinstance(ids, list) else ids["input_ids"])
    return engine.tokenize(p)


def _rejoined(a: list[int], b: list[int], window: int, max_shift: int = 2) -> bool:
    """Two continuations re-join when their last `window` tokens agree, allowing the branches to
    be shifted by up to `max_shift` tokens against each other (one said in more tokens)."""
    for s in range(-max_shift, max_shift + 1):
        aa, bb = (a[:len(a) - s] if s > 0 else a), (b[:len(b) + s] if s < 0 else b)
        if len(aa) >= window and len(bb) >= window and aa[-window:] == bb[-window:]:
            return True
    return False


class Positions:
    """Per response position: small model's hidden [N, H], top-k logits [N, k], greedy token [N],
    large model's token [N], prompt index [N] and position in the full sequence [N]."""

    def __init__(self, hidden, topk, small_tok, large_tok, prompt_idx, pos):
        self.hidden, self.topk, self.small_tok, self.large_tok = hidden, topk, small_tok, large_tok
        self.prompt_idx, self.pos = prompt_idx, pos

    def __len__(self):
        return len(self.small_tok)


@torch.inference_mode()
def collect(small: str | Path, seqs: list[tuple[list[int], list[int]]], topk: int, progress: bool,
            device: str = "cpu") -> Positions:
    """Prefill every prompt + response with the small model (HF, float32) and record its outputs at
    the positions that predict the response tokens."""
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(small), dtype=torch.float32).to(device).eval()
    hs, tks, st, lt, pi, ps = [], [], [], [], [], []
    for i, (prompt, resp) in enumerate(tqdm(seqs, desc="small prefill", unit="seq", disable=not progress)):
        if not resp:
            continue
        ids = torch.tensor([prompt + resp], device=device)
        h = model.model(input_ids=ids).last_hidden_state[0]  # final-normed [T, H]
        rows = torch.arange(len(prompt) - 1, len(prompt) + len(resp) - 1)
        h = h[rows.to(device)].float()
        logits = model.lm_head(h).float().cpu()
        h = h.cpu()
        k = min(topk, logits.shape[-1])
        hs.append(h)
        tks.append(torch.topk(logits, k, dim=-1).values)
        st.append(logits.argmax(-1))
        lt.append(torch.tensor(resp))
        pi.append(torch.full((len(resp),), i))
        ps.append(rows + 1)
    if not hs:
        raise ValueError("the large model wrote no response tokens: nothing to label")
    return Positions(torch.cat(hs), torch.cat(tks), torch.cat(st), torch.cat(lt), torch.cat(pi), torch.cat(ps))


def label(data: Positions, seqs, large_engine, verify_continuation: int, progress: bool) -> torch.Tensor:
    y = (data.small_tok != data.large_tok).float()
    K = int(verify_continuation)
    if K <= 0:
        return y
    diff = torch.nonzero(y).flatten().tolist()
    if not diff:
        return y
    branches = []
    for j in diff:
        prompt, resp = seqs[int(data.prompt_idx[j])]
        prefix = (prompt + resp)[:int(data.pos[j])]
        branches += [prefix + [int(data.large_tok[j])], prefix + [int(data.small_tok[j])]]
    outs = large_engine.generate(branches, max_tokens=K, temperature=0.0, ignore_eos=True, use_tqdm=progress)
    window = max(1, K // 4)
    for n, j in enumerate(diff):
        a = [branches[2 * n][-1]] + outs[2 * n].token_ids
        b = [branches[2 * n + 1][-1]] + outs[2 * n + 1].token_ids
        if _rejoined(a, b, window):
            y[j] = 0.0
    return y


# -- training --------------------------------------------------------------------------------------
def _forward(net: nn.Module, data: Positions, idx: torch.Tensor) -> torch.Tensor:
    if isinstance(net, R2RRouter):
        return net(data.hidden[idx], data.small_tok[idx], data.topk[idx]).squeeze(-1)
    return net(data.hidden[idx]).squeeze(-1)


def fit(net: nn.Module, data: Positions, target: torch.Tensor, idx: torch.Tensor, epochs: int, batch_size: int,
        lr: float, seed: int, progress: bool) -> list[float]:
    """Class-balanced BCE: the positive class is weighted by #negatives / #positives."""
    from tqdm.auto import tqdm
    g = torch.Generator().manual_seed(seed)
    yt = target[idx]
    npos = float(yt.sum())
    pos_weight = torch.tensor((len(yt) - npos) / npos if npos > 0 else 1.0)
    loss_fn = nn.BCEWithLogitsLoss(pos_weight=pos_weight)
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=lr, weight_decay=0.01)
    losses = []
    bar = tqdm(range(epochs), desc="train router", unit="epoch", disable=not progress)
    for _ in bar:
        net.train()
        perm = idx[torch.randperm(len(idx), generator=g)]
        total, n = 0.0, 0
        for s in range(0, len(perm), batch_size):
            b = perm[s:s + batch_size]
            if len(b) < 2 and isinstance(net, CITERRouter):
                continue  # BatchNorm needs two rows in training
            loss = loss_fn(_forward(net, data, b), target[b])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total, n = total + loss.item() * len(b), n + len(b)
        losses.append(total / max(n, 1))
        bar.set_postfix(loss=f"{losses[-1]:.4f}")
    net.eval()
    return losses


def pick_threshold(route_score: np.ndarray, divergent: np.ndarray, recall: float) -> tuple[float, float, float]:
    """Route when route_score >= t. -> (t, routed fraction, recall) for the largest t (lowest routed
    fraction) whose recall of divergent positions is >= `recall`."""
    pos = np.sort(route_score[divergent > 0])[::-1]
    if len(pos) == 0:
        return math.inf, 0.0, float("nan")
    t = float(pos[max(0, math.ceil(recall * len(pos)) - 1)])
    routed = route_score >= t
    return t, float(routed.mean()), float(routed[divergent > 0].mean())


def auc(score: np.ndarray, y: np.ndarray) -> float:
    """Area under the ROC curve (Mann-Whitney, ties counted half); nan with one class only."""
    pos, neg = score[y > 0], score[y <= 0]
    if len(pos) == 0 or len(neg) == 0:
        return float("nan")
    gt = (pos[:, None] > neg[None, :]).mean()
    eq = (pos[:, None] == neg[None, :]).mean()
    return float(gt + 0.5 * eq)


def train_router(policy: str = "r2r", small: str | Path = "", large: str | Path = "",
                 prompts: str | Path | Sequence[Any] = (), out: str | Path = "router.pt", *,
                 write_model: str | Path | None = None, max_tokens: int = 128,
                 verify_continuation: int = 0, epochs: int = 30, batch_size: int = 256, lr: float = 1e-3,
                 width: int = 256, blocks: int = 3, topk: int = 100, dropout: float = 0.1, recall: float = 0.95,
                 val_fraction: float = 0.2, seed: int = 0, device: str = "cpu", progress: bool = True) -> dict:
    """Train and save a router. Returns the figures it prints (threshold, routed fraction, recall,
    AUC on the held-out prompts, ...) and the trained network under "network". `write_model`
    (colm only): also write the small model with the trained deferral row as its (V+1)-th row."""
    from engines import Engine
    from engines.config import ModelConfig
    if policy not in ("r2r", "citer", "colm"):
        raise ValueError(f"train-router trains 'r2r', 'citer' or 'colm' routers, not {policy!r}")
    if write_model is not None and policy != "colm":
        raise ValueError("write_model writes a Co-LLM model directory: it goes with policy 'colm'")
    if not 0 < recall <= 1 or not 0 < val_fraction < 1:
        raise ValueError(f"recall must be in (0, 1] and val_fraction in (0, 1); got {recall}, {val_fraction}")
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    items = read_prompts(prompts)
    eng = Engine.from_pretrained(large, device=device)
    V, Vs = eng.model_config.vocab_size, ModelConfig.from_dir(small).vocab_size
    if Vs != V:
        raise ValueError(f"the small model's vocabulary ({Vs}) differs from the large model's ({V})")
    ids = [_tokenize(eng, p) for p in items]
    outs = eng.generate(ids, max_tokens=max_tokens, temperature=0.0, use_tqdm=progress)
    seqs = [(p, o.token_ids) for p, o in zip(ids, outs)]
    data = collect(small, seqs, topk, progress, device)
    y = label(data, seqs, eng, verify_continuation, progress)
    del eng

    # hold out whole prompts (positions of one response are correlated)
    rng = np.random.default_rng(seed)
    n_prompts = len(seqs)
    val_prompts = set(rng.permutation(n_prompts)[:max(1, round(val_fraction * n_prompts))].tolist())
    is_val = torch.tensor([int(p) in val_prompts for p in data.prompt_idx])
    if n_prompts < 2:
        is_val = torch.from_numpy(rng.random(len(data)) < val_fraction)
    tr, va = torch.nonzero(~is_val).flatten(), torch.nonzero(is_val).flatten()
    if len(tr) == 0 or len(va) == 0:
        raise ValueError(f"too little data to split: {len(data)} positions from {n_prompts} prompts")

    H = data.hidden.shape[1]
    small_name = str(Path(small).resolve())  # what from_pretrained takes: R2R's pretrained_model_name
    if policy == "r2r":
        net: nn.Module = R2RRouter(load_embedding(small), H, logits_size=data.topk.shape[1],
                                   hidden_dims=[width] * blocks, dropout_rate=dropout, pretrained_model_name=small_name)
        target = y  # 1 = divergent: route
    elif policy == "colm":
        net = DeferralRow(load_output_head(small).mean(0))  # Co-LLM's initialization of the new row
        target = y  # 1 = divergent: defer
    else:
        net = CITERRouter(H, dropout=dropout)
        target = 1.0 - y  # 1 = the small model's token is fine: confident
    losses = fit(net, data, target, tr, epochs, batch_size, lr, seed, progress)

    with torch.inference_mode():
        p = torch.sigmoid(_forward(net, data, va)).numpy()
    div = y[va].numpy()
    score = -p if policy == "citer" else p  # higher: route
    t, frac, rec = pick_threshold(score, div, recall)
    if policy == "r2r":  # route when p >= threshold
        thr = min(t, 1.0)
    elif policy == "colm":  # defer when p > eta, strictly (Co-LLM's rule)
        thr = 1.0 if math.isinf(t) else float(np.nextafter(np.float32(t), np.float32(-np.inf)))
    else:  # route when confidence < tau
        thr = 0.0 if math.isinf(t) else float(np.nextafter(np.float32(-t), np.float32(np.inf)))
    stats = {"policy": policy, "threshold": float(thr), "routed_fraction": frac, "recall": rec,
             "auc": auc(score, div), "divergent_rate": float(y.mean()), "positions": len(data),
             "train_positions": len(tr), "val_positions": len(va),
             "final_loss": losses[-1] if losses else float("nan"), "seconds": time.perf_counter() - t0}
    record = dict(small=small_name, large=str(large), recall_target=recall,
                  verify_continuation=int(verify_continuation), val_routed_fraction=frac, val_recall=rec,
                  divergent_rate=stats["divergent_rate"])
    arg = {"r2r": "threshold", "citer": "tau", "colm": "eta"}[policy]
    if policy == "colm":
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        torch.save({"weight": net.weight.detach().clone(), "bias": 0.0, "eta": float(thr), **record}, str(out))
        if write_model is not None:
            write_deferral_model(small, write_model, net.weight)
    else:
        save_router(net, out, thr, **record)
    print(f"{policy} router -> {out}{f' and {write_model}' if write_model else ''}: {arg} {thr:.6g}; on {len(va)} "
          f"held-out positions ({int(div.sum())} divergent) it routes {frac:.1%} with recall {rec:.1%}, AUC "
          f"{stats['auc']:.3f} (divergent rate {stats['divergent_rate']:.1%}, {stats['seconds']:.1f}s)")
    if policy != "r2r":
        print(f"  serve it with policy_args {arg}={thr:.6g}: the default is the paper's "
              f"{'0.98' if policy == 'citer' else '0.15'}")
    return {**stats, "network": net}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="aiorouter train-router", description=__doc__.split("\n\n")[0])
    ap.add_argument("--policy", choices=("r2r", "citer", "colm"), required=True)
    ap.add_argument("--small", required=True, help="small model directory (HF safetensors)")
    ap.add_argument("--large", required=True, help="large model directory")
    ap.add_argument("--prompts", required=True, help="JSON-lines prompt file")
    ap.add_argument("--out", required=True, help="where to write the router (.pt)")
    ap.add_argument("--write-model", metavar="DIR", help="colm: also write the small model with the trained "
                    "deferral row as its (V+1)-th output row (Co-LLM's layout, served by policy colm as is)")
    ap.add_argument("--max-tokens", type=int, default=128, help="response length per prompt")
    ap.add_argument("--verify-continuation", type=int, default=0, metavar="K",
                    help="label a mismatch divergent only if K-token continuations do not re-join (R2R)")
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--width", type=int, default=256, help="R2R router width W (official: 1024)")
    ap.add_argument("--blocks", type=int, default=3, help="R2R residual blocks K (official: 6)")
    ap.add_argument("--topk", type=int, default=100, help="R2R: top logits fed to the router")
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--recall", type=float, default=0.95, help="recall target for picking the threshold")
    ap.add_argument("--val-fraction", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="device the models run on (the router trains on the CPU)")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    a = ap.parse_args(argv)
    try:
        train_router(a.policy, a.small, a.large, a.prompts, a.out, write_model=a.write_model, max_tokens=a.max_tokens,
                     verify_continuation=a.verify_continuation, epochs=a.epochs, batch_size=a.batch_size, lr=a.lr,
                     width=a.width, blocks=a.blocks, topk=a.topk, dropout=a.dropout, recall=a.recall,
                     val_fraction=a.val_fraction, seed=a.seed, device=a.device, progress=not a.quiet)
    except (ValueError, FileNotFoundError) as e:
        print(f"train-router: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
