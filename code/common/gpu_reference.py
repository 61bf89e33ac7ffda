"""One real GPU measured against the time model (common/timemodel.py): an NVIDIA H200 timed on 2026-12-04
doing what code/lecture27/gpu_check.py times (full prefill, one layer against its 15% selective recompute,
KV copied from CPU memory, decode steps, §5.4's pipeline), kept as data in gpu_reference.json beside this
file, with its source. The pages print it as a reference column of its own, labelled with the GPU and the
date (01's Part 2, 04's Part 4, and gpu_check.py beside your GPU's figures), looked up through
common.present.handout like the handout's figures: a figure shows only while the run's inputs are the ones
it was measured at. Nothing is computed from it but the text of its figures.

A row's key names what was timed, the same key gpu_check.py gives the row it measures (`row_key`):
  prefill MODEL N                  a full prefill of N tokens, every layer
  layer MODEL N                    one layer's full prefill of N tokens
  recompute MODEL N                one layer's selective recompute of `ratio` of N tokens (CacheBlend, §5.3)
  layer_kv MODEL N pinned          one layer's KV of N tokens copied from pinned CPU memory to the GPU
  kv MODEL N pinned|pageable       every layer's KV of N tokens copied at once (+ " per-layer": layer by layer)
  decode MODEL N batch B           one decode step of B sequences N tokens long (the layers only)
  pipeline MODEL N serial|pipelined  §5.4: each layer's KV loaded, then its `ratio` recomputed, one after the
                                   other / the loads on a second CUDA stream beside the previous layer's recompute
  matmul N                         one N x N by N x N matmul
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from . import timemodel as tm
from .present import Ref

PATH = Path(__file__).with_name("gpu_reference.json")


def row_key(kind: str, model: str | None = None, tokens: int | None = None, *, batch: int | None = None,
            memory: str | None = None, per_layer: bool = False, schedule: str | None = None,
            attention: str | None = None) -> str:
    """The name of one timed quantity, as the reference and gpu_check.py's --json both key it."""
    parts = [kind, model, None if tokens is None else str(tokens), None if batch is None else f"batch {batch}",
             memory, "per-layer" if per_layer else None, schedule, attention]
    return " ".join(p for p in parts if p)


@dataclass(frozen=True)
class Measured:
    """One timed quantity: what was timed (the fields of its key), the median seconds, and the inputs it holds
    for beyond its key (the recompute ratio, the bytes per KV value)."""
    key: str
    kind: str
    model: str | None
    tokens: int | None
    seconds: float
    inputs: dict
    run: int
    what: str


@dataclass(frozen=True)
class Reference:
    gpu: str                # the row of timemodel.GPUS it was measured on
    device: str             # torch.cuda.get_device_name
    date: str
    torch: str
    dtype: str
    source: str             # who measured it, where the record is
    method: str             # how it was measured
    rows: dict              # key -> Measured
    facts: dict             # the run's headline rates: matmul TFLOP/s, host-to-GPU GB/s

    @property
    def label(self) -> str:
        """The reference column's header: "H200 measured (2026-12-04)"."""
        return f"{self.gpu} measured ({self.date})"


def load(path: Path = PATH) -> Reference:
    data = json.loads(Path(path).read_text())
    rows = {}
    for r in data["rows"]:
        extra = {k: r[k] for k in ("batch", "memory", "per_layer", "schedule", "attention") if k in r}
        key = row_key(r["kind"], r.get("model"), r.get("tokens"), **extra)
        inputs = {"ratio": r["ratio"]} if "ratio" in r else {}
        if r["kind"] in ("kv", "layer_kv", "decode", "pipeline"):
            inputs["bytes_per_value"] = tm.SERVED_BYTES_PER_VALUE   # the KV it moved or read was BF16
        rows[key] = Measured(key=key, kind=r["kind"], model=r.get("model"), tokens=r.get("tokens"),
                             seconds=r["measured_s"], inputs=inputs, run=r["run"], what=r["what"])
    facts = {k: data[k] for k in ("matmul_tflops", "h2d_pinned_GBps", "h2d_pageable_GBps")}
    return Reference(gpu=data["gpu"], device=data["device"], date=data["date"], torch=data["torch"],
                     dtype=data["dtype"], source=data["source"], method=data["method"], rows=rows, facts=facts)


H200 = load()


def ms_text(seconds: float) -> str:
    """A time as the tables write it: 1,251 ms, 348 ms, 25.4 ms, 2.70 ms, 0.867 ms."""
    ms = 1e3 * seconds
    return f"{ms:,.0f} ms" if ms >= 100 else f"{ms:.1f} ms" if ms >= 10 else f"{ms:.2f} ms" if ms >= 1 else \
        f"{ms:.3f} ms"


def kv_bytes(row: Measured) -> float:
    """The bytes a KV row moved: every layer's KV of its tokens, or one layer's (BF16)."""
    m = tm.get_model(row.model)
    total = tm.kv_bytes_per_token(m) * row.tokens
    return total / m.n_layers if row.kind == "layer_kv" else total


def figure_text(ref: Reference, row: Measured) -> str:
    """A measured row as its reference cell shows it: the time, with the copy's rate (KV rows) or the share of
    the full layer's time (a recompute row whose layer was measured at the same length)."""
    text = ms_text(row.seconds)
    if row.kind in ("kv", "layer_kv"):
        return f"{text} ({kv_bytes(row) / row.seconds / 1e9:.0f} GB/s)"
    layer = ref.rows.get(row_key("layer", row.model, row.tokens))
    if row.kind == "recompute" and layer is not None:
        return f"{text} ({row.seconds / layer.seconds:.0%} of the layer)"
    return text


def refs(ref: Reference, names: dict[str, str]) -> dict[str, Ref]:
    """The reference as a page's table of figures (a present.Handout): key -> Ref of the row's text and the
    inputs it holds for, named as the page's settings name them. `names`: input -> the page's setting; the GPU
    is the input "gpu" (the time model's GPU the page sets beside it). An input the page has no setting for is
    one its runs cannot change, and is left out."""
    inputs = lambda row: {names[k]: v for k, v in {"gpu": ref.gpu, **row.inputs}.items() if k in names}
    return {key: Ref(figure_text(ref, row), inputs(row)) for key, row in ref.rows.items()}
