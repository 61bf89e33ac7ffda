"""CacheBlend's costs on the time model (common/timemodel.py), for a RAG request on one GPU type:
what its check costs at layer 0 against layer 1 (handout §5.3, exercise 7), and how loading a layer's KV
hides the recompute of the next (§5.4): per storage device the load, the controller's ratio
(loading_controller.py), the pipelined TTFT and the controller's choice; CacheBlend's per-layer paper
point; the requests/s of a busy server, full prefill against CacheBlend.

    check_cost     exercise 7: the check at layer 0 (one more attention pass) vs layer 1 (a layer of prefill)
    system_timing  §5.4 for one (model, GPUs): one layer's recompute and loads, per device
    throughput     §5.4: requests/s of a server kept busy, full prefill vs CacheBlend
    controller_example  exercise 8: the controller on given per-layer read and prefill times
    query_wait     §5.4 for a query rule: the pipelined TTFT when the ranking reads layers 1..j first
    one_gpu        §5.3-5.4 on one GPU: a layer's full prefill, its recompute, its KV's read from pinned CPU
                   memory, and every layer loaded and recomputed, one after the other or on two streams
"""
from __future__ import annotations

from dataclasses import dataclass

from lecture27 import loading_controller as lc
from common import timemodel as tm
from common.gpu_reference import row_key


@dataclass(frozen=True)
class Rag:
    """§5.4's RAG request: `chunks` x `chunk_tokens` of context + a `question`-token question on `gpu`;
    devices: storage device -> (how its bandwidth is shared, bytes/s); CacheBlend's floor `min_ratio`."""
    gpu: str
    chunks: int
    chunk_tokens: int
    question: int
    devices: dict
    min_ratio: float

    @property
    def n_ctx(self) -> int:
        return self.chunks * self.chunk_tokens


@dataclass(frozen=True)
class Paper:
    """CacheBlend's per-layer example: `ratio` of a layer recomputed at `context` tokens, read from `device`."""
    context: int
    ratio: float
    device: str


# ---------------------------------------------------------------------------- §5.3, exercise 7
@dataclass(kw_only=True)
class CheckCost:
    model: str
    n_gpus: int
    n_ctx: int
    layer0_gflop: float
    layer1_gflop: float
    layer0_ms: float
    layer1_ms: float
    full_layer_ms: float
    full_prefill_ms: float


def check_cost(model: str, n_gpus: int, n_ctx: int, gpu: str) -> CheckCost:
    """What CacheBlend's check costs at layer 0 and at layer 1, on the time model.
    Layer 0: K, V depend only on token and position, so the precomputed ones are exact; the check is one
    more attention pass (queries of every token against every earlier key) beside the own-chunk one.
    Layer 1: its true K, V need layer 0's output with full attention, for every token: a whole layer of
    prefill, then the same attention pass."""
    m = tm.get_model(model)
    attn = m.attn_pair_flops * tm.causal_pairs(n_ctx)
    q_proj = 2 * m.d_model * m.n_heads * m.head_dim * n_ctx
    layer0 = tm.prefill_layer_time(model, gpu, n_ctx, 0, n_gpus)            # a full layer, all tokens
    layer_flops = 2 * m.linear_params / m.n_layers * n_ctx + attn
    per_flop = layer0 / layer_flops                                        # the time model's s/FLOP here
    return CheckCost(model=model, n_gpus=n_gpus, n_ctx=n_ctx, layer0_gflop=(attn + q_proj) / 1e9,
                     layer1_gflop=(layer_flops + attn + q_proj) / 1e9, layer0_ms=1e3 * (attn + q_proj) * per_flop,
                     layer1_ms=1e3 * (layer0 + (attn + q_proj) * per_flop), full_layer_ms=1e3 * layer0,
                     full_prefill_ms=1e3 * m.n_layers * layer0)


# ---------------------------------------------------------------------------- §5.4
@dataclass(kw_only=True)
class DeviceTiming:
    load_ms: float                  # one layer's KV read from the device
    ratio: float                    # the controller's recompute ratio
    recompute_ms: float
    ttft_s: float                   # pipelined CacheBlend
    speedup: float                  # full prefill TTFT / CacheBlend TTFT
    load_vs_full: float             # full recompute of a layer / its load
    choice: str                     # the controller's, KV kept here: "blend", "blend from <device>", "full prefill"
    reason: str                     # why (loading_controller.choose)


@dataclass
class PaperPoint:
    recompute_ms: float             # the paper's ratio of a layer at the paper's context
    load_ms: float                  # its read from the paper's device


@dataclass
class Throughput:
    full_rps: float
    blend_rps: float
    gpu_s: float
    load_s: float
    bound: str                      # "GPU" or the device


@dataclass(kw_only=True)
class SystemTiming:
    n_gpus: int
    tag: str
    full_layer_ms: float
    floor_layer_ms: float
    prefill_s: float
    devices: dict[str, DeviceTiming]
    paper: PaperPoint
    throughput: dict[float, Throughput]   # recompute ratio -> requests/s


def throughput(model, n_gpus: int, ratio: float, device: str, rag: Rag) -> Throughput:
    """Requests/s of one server on the RAG requests when it is busy all the time: full prefill spends the
    GPUs' prefill of the whole prompt per request; CacheBlend spends the recompute at `ratio` plus the
    question, its loads overlapping other requests' compute, so the device's bandwidth caps it (KV bytes
    per request / bandwidth)."""
    n_ctx, gpu = rag.n_ctx, rag.gpu
    full = tm.prefill_time(model, gpu, n_ctx + rag.question, 0, n_gpus)
    gpu_s = (tm.recompute_time(model, gpu, n_ctx, ratio, n_gpus)
             + tm.prefill_time(model, gpu, rag.question, n_ctx, n_gpus))
    load_s = lc.load_time(model, n_ctx, device, n_gpus, rag.devices) * tm.get_model(model).n_layers
    return Throughput(1 / full, 1 / max(gpu_s, load_s), gpu_s, load_s, "GPU" if gpu_s >= load_s else device)


def system_timing(model: str, n_gpus: int, rag: Rag, paper: Paper) -> SystemTiming:
    """One layer's full and floor-ratio recompute, and per device the load, the controller's ratio, the
    pipelined TTFT; CacheBlend's per-layer paper point; a busy server's requests/s."""
    n_ctx, gpu, m = rag.n_ctx, rag.gpu, tm.get_model(model)
    full_layer = tm.recompute_time(model, gpu, n_ctx, 1.0, n_gpus) / m.n_layers
    floor_layer = tm.recompute_time(model, gpu, n_ctx, rag.min_ratio, n_gpus) / m.n_layers
    question = tm.prefill_time(model, gpu, rag.question, n_ctx, n_gpus)
    prefill = tm.prefill_time(model, gpu, n_ctx + rag.question, 0, n_gpus)
    devices, loads = {}, {d: lc.load_time(model, n_ctx, d, n_gpus, rag.devices) for d in rag.devices}
    for device, load in loads.items():
        r = lc.controller_ratio(load, full_layer, rag.min_ratio)
        recompute = tm.recompute_time(model, gpu, n_ctx, r, n_gpus) / m.n_layers
        ttft = lc.pipelined_ttft(m.n_layers, load, recompute, question)
        c = lc.choose(m.n_layers, full_layer, loads, device, rag.min_ratio, question)
        devices[device] = DeviceTiming(load_ms=1e3 * load, ratio=r, recompute_ms=1e3 * recompute, ttft_s=ttft,
                                       speedup=prefill / ttft, load_vs_full=full_layer / load,
                                       choice=choice_label(c), reason=c.reason)
    point = PaperPoint(1e3 * tm.recompute_time(model, gpu, paper.context, paper.ratio, n_gpus) / m.n_layers,
                       1e3 * lc.load_time(model, paper.context, paper.device, n_gpus, rag.devices))
    tput = {r: throughput(model, n_gpus, r, paper.device, rag)
            for r in sorted({devices[paper.device].ratio, rag.min_ratio})}
    return SystemTiming(n_gpus=n_gpus, tag=m.tag, full_layer_ms=1e3 * full_layer, floor_layer_ms=1e3 * floor_layer,
                        prefill_s=prefill, devices=devices, paper=point, throughput=tput)


def choice_label(c: lc.Choice) -> str:
    """The controller's choice in a table cell: "blend" (from where the KV is), "blend from <device>", "full
    prefill"."""
    return c.choice if c.device in (None, c.stored) else f"{c.choice} from {c.device}"


# ---------------------------------------------------------------------------- §5.4, exercise 8
def controller_example(layers: int, read_ms: float, prefill_ms: float, min_ratio: float) -> lc.Choice:
    """Exercise 8's controller: the KV on an SSD, `layers` layers, each read in read_ms and prefilled in
    prefill_ms (the question left out, as the exercise says)."""
    return lc.choose(layers, prefill_ms / 1e3, {"SSD": read_ms / 1e3}, "SSD", min_ratio)


# ---------------------------------------------------------------------------- §5.4, a rule that reads the question
@dataclass(kw_only=True)
class QueryWait:
    """A query rule on the time model, KV read from `device` at the device's controller ratio: per depth j
    (the question's attention read at layers 1..j; j = -1 is the plain pipeline), the TTFT and its cost
    over blend's pipelined TTFT."""
    model: str
    n_gpus: int
    device: str
    ratio: float
    n_layers: int
    load_ms: float
    recompute_ms: float
    pass_ms: float                  # the question's pass over one layer of stale KV
    depths: list
    ttft_s: list
    plain_s: float                  # the same ratio, no ranking pass (pipelined_ttft)
    prefill_s: float


def query_wait(model: str, n_gpus: int, rag: Rag, device: str, depths) -> QueryWait:
    """The pipelined TTFT of a query rule ranking by layers 1..j for each j of `depths` (clipped to the
    model's last layer), on `device`, at the controller's ratio (the same ratio for every j)."""
    n_ctx, gpu, m = rag.n_ctx, rag.gpu, tm.get_model(model)
    L = m.n_layers
    full_layer = tm.recompute_time(model, gpu, n_ctx, 1.0, n_gpus) / L
    load = lc.load_time(model, n_ctx, device, n_gpus, rag.devices)
    r = lc.controller_ratio(load, full_layer, rag.min_ratio)
    recompute = tm.recompute_time(model, gpu, n_ctx, r, n_gpus) / L
    question = tm.prefill_time(model, gpu, rag.question, n_ctx, n_gpus)
    js = sorted({min(j, L - 1) for j in depths})
    return QueryWait(model=model, n_gpus=n_gpus, device=device, ratio=r, n_layers=L, load_ms=1e3 * load,
                     recompute_ms=1e3 * recompute, pass_ms=1e3 * question / L, depths=js,
                     ttft_s=[lc.ranked_ttft(L, load, recompute, j, question / L, question) for j in js],
                     plain_s=lc.pipelined_ttft(L, load, recompute, question),
                     prefill_s=tm.prefill_time(model, gpu, n_ctx + rag.question, 0, n_gpus))


# ---------------------------------------------------------------------------- §5.3-5.4 on one GPU
@dataclass(frozen=True)
class OneGpuRow:
    """One quantity on one GPU of the time model: its key (common.gpu_reference.row_key: the name a real GPU's
    measurement of it has), its words and the time model's seconds."""
    key: str
    label: str
    model_s: float


def one_gpu(models, gpu: str, contexts, ratio: float) -> list[OneGpuRow]:
    """§5.3-5.4 on one `gpu` of the time model, per model and context: one layer's full prefill, its recompute
    of `ratio`, its KV read from pinned CPU memory (its bytes over the GPU's host link); then over every layer,
    each layer's KV loaded and its `ratio` recomputed, one after the other (L x (load + recompute)) against
    the loads on a second stream (loading_controller.streamed_s)."""
    pinned = {"pinned CPU memory": ("per_gpu", tm.GPUS[gpu].pcie_bw)}
    out = []
    for model in models:
        m = tm.get_model(model)
        for n in contexts:
            load = lc.load_time(model, n, "pinned CPU memory", 1, pinned)
            rec = tm.recompute_time(model, gpu, n, ratio) / m.n_layers
            where = f"{m.name}, {n:,} tokens"
            out += [OneGpuRow(row_key("layer", model, n), f"{where}: one layer, full prefill",
                              tm.prefill_layer_time(model, gpu, n)),
                    OneGpuRow(row_key("recompute", model, n), f"{where}: one layer, {ratio:.0%} recomputed", rec),
                    OneGpuRow(row_key("layer_kv", model, n, memory="pinned"),
                              f"{where}: one layer's KV from pinned CPU memory", load),
                    OneGpuRow(row_key("pipeline", model, n, schedule="serial"),
                              f"{where}: {m.n_layers} layers, load then recompute", m.n_layers * (load + rec)),
                    OneGpuRow(row_key("pipeline", model, n, schedule="pipelined"),
                              f"{where}: {m.n_layers} layers, loads on a second stream",
                              lc.streamed_s(m.n_layers, load, rec))]
    return out
