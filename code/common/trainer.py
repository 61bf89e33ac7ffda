"""The one training loop every small model uses (the city LLaMA, the record-world model): the weights'
initialisation, the learning-rate schedule (warmup, then cosine decay) and AdamW over a weighted
cross-entropy. A trained model is cached by checkpoints.cached_model, keyed by this code.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from tqdm import tqdm

from .llama import Llama


def init_weights(model: Llama, generator: torch.Generator, embed_std: float, linear_std: float) -> None:
    """Every matrix drawn from N(0, std^2): embeddings at embed_std, linear layers at linear_std (the
    usual 1/sqrt(fan_in) scale for the lecture's d = 64 models is 0.125); norm gains untouched.
    llama.py's own N(0, 0.02) leaves every hidden state alike at the start, and these tiny models then
    sit on a plateau for a long time: the record model for thousands of steps, the city model (for
    about half of the seeds) for the whole run."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, embed_std if name.startswith("embed") else linear_std, generator=generator)


def lr_at(step: int, steps: int, lr: float, warmup: int, min_lr_frac: float) -> float:
    """Linear warmup, then cosine decay to min_lr_frac * lr."""
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return lr * (min_lr_frac + (1 - min_lr_frac) * 0.5 * (1 + math.cos(math.pi * t)))


def train_lm(model: Llama, batch_fn, steps: int, lr: float, warmup: int = 100, min_lr_frac: float = 0.1,
             weight_decay: float = 0.0, desc: str = "train", eval_every: int | None = None,
             eval_fn=None, seed: int = 0, grad_clip: float = 1.0, extra_loss=None, lr_fn=None) -> dict:
    """The training loop for the lecture's small models.

    batch_fn(step, generator) -> (inputs (B,T), targets (B,T), weights (B,T)): the loss is the
    cross-entropy at each position weighted by `weights` (0 where a position is not trained).
    eval_fn(model, step) -> dict of metrics, recorded every eval_every steps (model in eval mode); a
    true "stop" in it ends training after that step (a trainer that decides its own length).
    lr_fn(step) -> learning rate of that step, instead of lr_at's warmup and cosine over `steps`.
    extra_loss(model, step) -> scalar tensor added to the loss after each forward (e.g. a penalty on the
    attention weights the forward kept); its values are recorded under "extra".
    Returns {"step": [...], "loss": [...], "evals": [{"step": s, ...}], "extra": [...]}.
    """
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=(0.9, 0.98))
    hist = {"step": [], "loss": [], "evals": [], "extra": []}
    model.train()
    bar = tqdm(range(steps), desc=desc, leave=False, mininterval=0.5)
    ema = None
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_fn(step) if lr_fn is not None else lr_at(step, steps, lr, warmup, min_lr_frac)
        x, y, w = batch_fn(step, g)
        logits, _ = model(x)
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="none")
        loss = (ce * w.reshape(-1)).sum() / w.sum()
        extra = extra_loss(model, step) if extra_loss is not None else torch.zeros(())
        hist["extra"].append(extra.item())
        opt.zero_grad(set_to_none=True)
        (loss + extra).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        opt.step()
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        hist["step"].append(step)
        hist["loss"].append(loss.item())
        if eval_fn is not None and eval_every and ((step + 1) % eval_every == 0 or step + 1 == steps):
            model.eval()
            with torch.no_grad():
                hist["evals"].append({"step": step + 1, **eval_fn(model, step + 1)})
            model.train()
            if hist["evals"][-1].get("stop"):
                break
        if step % 20 == 0:
            bar.set_postfix(loss=f"{ema:.3f}")
    bar.close()
    model.eval()
    return hist
