"""Train once, then load: the trained-checkpoint cache, and the one training loop every small model uses.

A checkpoint file is named <name>-<key>.pt, where key hashes the model config, the training config and
a version string of the data generator. Change any of them and a new file is trained; a file that
fails to load or whose stored config differs is retrained with a one-line message, never used
silently. Files are written to a temporary name and renamed, so a killed run never leaves half a file.
The folder is code/checkpoints/, or $L27_CHECKPOINTS.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from tqdm import tqdm

from .llama import Llama, LlamaConfig

FORMAT = 1  # bump when the file layout changes

# what this process loaded from the cache and what it computed: {"name", "loaded", "seconds"}; the report
# says which results came from code/checkpoints/
EVENTS: list[dict] = []


class TrainingFailed(RuntimeError):
    """Raised by a train_fn whose model is not good enough to cache."""


def checkpoint_dir() -> Path:
    d = Path(os.environ.get("L27_CHECKPOINTS", Path(__file__).resolve().parents[1] / "checkpoints"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def cache_key(*parts) -> str:
    """Short stable hash of JSON-able parts (sorted keys)."""
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def atomic_save(obj, path: Path) -> None:
    """torch.save to a temporary file in the same folder, then rename over `path`."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    os.close(fd)
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def plain(x):
    """x with numpy arrays and scalars turned into lists and Python numbers, tuples into lists: the
    plain data a cached result is stored as (and what a later run loads back)."""
    if isinstance(x, dict):
        return {k: plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    if hasattr(x, "tolist"):  # numpy arrays and scalars, tensors
        return x.tolist()
    return x


def cached_result(name: str, ident: dict, compute: Callable[[], dict], refit: bool = False,
                  tag: str = "cache", flag: str = "--refit") -> dict:
    """A computed result (a dict of plain data) cached like a checkpoint: file <name>-<hash of ident>.pt.
    A stored file whose identity differs, or that fails to load, is recomputed with a message; a
    loaded one says so in one line, with the script flag (`flag`) that computes it again."""
    ident = json.loads(json.dumps({"format": FORMAT, **ident}, default=str))
    path = checkpoint_dir() / f"{name}-{cache_key(ident)}.pt"
    if path.exists() and not refit:
        try:
            blob = torch.load(path, weights_only=True)
            if blob["ident"] != ident:
                raise ValueError("stored identity differs")
            result = blob["result"]
            print(f"[{tag}] {name}: loaded from {path.name} (computed in {result['compute_seconds']:.0f} s; "
                  f"{flag} computes it again)")
            EVENTS.append({"name": name, "loaded": True, "seconds": result["compute_seconds"]})
            return result
        except Exception as e:  # a broken or foreign file is never used silently
            print(f"[{tag}] {path.name} is unusable ({type(e).__name__}: {e}); recomputing")
    t0 = time.time()
    result = plain(compute())
    result["compute_seconds"] = time.time() - t0
    atomic_save({"ident": ident, "result": result}, path)
    print(f"[{tag}] computed {name} in {result['compute_seconds']:.0f} s -> {path}")
    EVENTS.append({"name": name, "loaded": False, "seconds": result["compute_seconds"]})
    return result


def cached_model(name: str, model_cfg: LlamaConfig, train_cfg: dict, data_version: str,
                 train_fn: Callable[[Llama], dict], retrain: bool = False,
                 seed: int = 0) -> tuple[Llama, dict]:
    """Load the trained model `name` for these configs, or build and train it, then cache it.

    train_fn(model) trains in place and returns JSON-able final metrics (or raises TrainingFailed).
    Returns (model in eval mode, meta); meta holds the configs, seed, torch version, metrics and
    training time.
    """
    ident = {"name": name, "model": model_cfg.to_dict(), "train": train_cfg, "data": data_version,
             "seed": seed, "format": FORMAT}
    path = checkpoint_dir() / f"{name}-{cache_key(ident)}.pt"
    if path.exists() and not retrain:
        try:
            blob = torch.load(path, weights_only=True)
            if blob["meta"]["ident"] != json.loads(json.dumps(ident)):
                raise ValueError("stored config differs")
            model = Llama(model_cfg)
            model.load_state_dict(blob["state_dict"])
            EVENTS.append({"name": name, "loaded": True, "seconds": blob["meta"]["train_seconds"]})
            return model.eval(), blob["meta"]
        except Exception as e:  # a broken or foreign file is never used silently
            print(f"[checkpoints] {path.name} is unusable ({type(e).__name__}: {e}); retraining")

    torch.manual_seed(seed)
    model = Llama(model_cfg)
    t0 = time.time()
    metrics = train_fn(model)
    meta = {"ident": json.loads(json.dumps(ident)), "metrics": metrics, "train_seconds": time.time() - t0,
            "torch": str(torch.__version__), "n_params": model.n_params()}
    atomic_save({"state_dict": model.state_dict(), "meta": meta}, path)
    print(f"[checkpoints] trained {name} in {meta['train_seconds']:.1f} s -> {path}")
    EVENTS.append({"name": name, "loaded": False, "seconds": meta["train_seconds"]})
    return model.eval(), meta


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
