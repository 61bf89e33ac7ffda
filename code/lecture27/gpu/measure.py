"""What gpu_check.py times on one device (handout §1.4, §5.3, §5.4; lecture 26's time model,
common/timemodel.py): LLaMA layers with random weights of a model's published shapes (the time model's own
table, MODELS), run in BF16, each figure the median of several timed runs after warm-ups.

    Device            where the layers run and how they are timed: CUDA events on a GPU; perf_counter on the
                      CPU (--tiny), where "pinned" memory is ordinary memory and there is no second stream
    random_layers     each layer's weights, random, of the model's shapes (Q, K, V fused; gate and up fused,
                      as serving engines keep them)
    prefill_layer     one layer's full prefill: every token attends to the keys at or before it
    recompute_layer   CacheBlend's selective recompute of one layer: the selected tokens' K, V written into the
                      loaded cache, their queries attending to the whole cache, each only to the keys at or
                      before its own position (recompute_mask), then their MLP
    decode_layer      one decode step of one layer: a new token per sequence, its K, V appended to the cache
    the studies       prefill, one_layer, kv_copy, decode, pipeline, matmul: each returns its Timed rows, the
                      measured median beside the time model's figure for the GPU row `gpu`

Grouped-query attention (n_kv_heads < n_heads): the G = n_heads / n_kv_heads query heads that read one KV
head are folded into that head's rows (`attend`), so the selective recompute's mask and the decode step need
no copy of K and V per query head, on any attention kernel."""
from __future__ import annotations

import math
import statistics
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from common import timemodel as tm
from common.gpu_reference import row_key
from lecture27 import loading_controller as lc

ROPE_THETA = 500000.0   # LLaMA-3's RoPE base (the angles do not change the time)
NORM_EPS = 1e-5
OOM = getattr(torch.cuda, "OutOfMemoryError", RuntimeError)


# ------------------------------------------------------------------------------------------- the device
class Device:
    """Where the layers run and how they are timed. cuda: a CUDA device, timed by CUDA events; else this CPU,
    timed by perf_counter (--tiny: the same code on small shapes)."""

    def __init__(self, cuda: bool, dtype=torch.bfloat16, seed: int = 0):
        self.cuda, self.dtype = cuda, dtype
        self.device = torch.device("cuda" if cuda else "cpu")
        self.gen = torch.Generator(device=self.device).manual_seed(seed)
        self.name = torch.cuda.get_device_name() if cuda else "this CPU"
        self.timer = "CUDA events" if cuda else "perf_counter"

    def randn(self, *shape, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen, device=self.device, dtype=self.dtype) * scale

    def host(self, shape, pinned: bool) -> torch.Tensor:
        """A tensor of zeros in CPU memory (what a copy moves does not change its time), page-locked (pinned)
        when asked and there is a GPU to copy it to: the GPU's copy engine reads pinned memory directly;
        pageable memory goes through a staging buffer first."""
        return torch.zeros(*shape, dtype=self.dtype, pin_memory=pinned and self.cuda)

    def empty(self, shape) -> torch.Tensor:
        return torch.empty(*shape, device=self.device, dtype=self.dtype)

    def stream(self):
        """A second stream (None on the CPU: its work runs in order on the one)."""
        return torch.cuda.Stream() if self.cuda else None

    def on(self, stream):
        return torch.cuda.stream(stream) if stream is not None else nullcontext()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def free(self) -> None:
        """Give the memory of the study just ended back, so the next one finds the device empty."""
        if self.cuda:
            torch.cuda.empty_cache()

    def median_s(self, fn, warmup: int, runs: int) -> float:
        """The median seconds of `runs` calls of fn after `warmup` untimed ones. On a GPU each call is timed
        by two CUDA events around it on the current stream (work fn puts on another stream is joined back to
        it inside fn), so the time is the device's, not the launching CPU's."""
        for _ in range(warmup):
            fn()
        self.sync()
        times = []
        for _ in range(runs):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)


def gpu_row(device_name: str) -> str | None:
    """The row of timemodel.GPUS a device is: every word of the row's key ("A100-80GB": A100 and 80GB) among
    the words of the name torch gives it ("NVIDIA A100-SXM4-80GB"); None when no row matches."""
    words = set(device_name.upper().replace("-", " ").replace("_", " ").split())
    return next((key for key in sorted(tm.GPUS, key=len, reverse=True)
                 if set(key.upper().replace("-", " ").split()) <= words), None)


# ------------------------------------------------------------------------------------------- one layer
def ffn_width(model) -> int:
    """The SwiGLU width of a dense model of the time model's table: what its layer's linear parameters leave
    after Wq, Wk, Wv and Wo, over the three d x d_ff matrices."""
    m = tm.get_model(model)
    attention = 2 * m.d_model * m.n_heads * m.head_dim + 2 * m.d_model * m.n_kv_heads * m.head_dim
    width = (m.linear_params / m.n_layers - attention) / (3 * m.d_model)
    if m.kv_latent or m.total_params != m.active_params or width != int(width):
        raise ValueError(f"{m.name} is not a dense LLaMA of the time model's table")
    return int(width)


def dense_models() -> list[str]:
    """The models of the time model's table this check can build: the dense LLaMAs."""
    out = []
    for key in tm.MODELS:
        try:
            ffn_width(key)
            out.append(key)
        except ValueError:
            pass
    return out


@dataclass
class Layer:
    """One layer's weights, each (in, out): Q, K, V fused, then the output projection; gate and up fused, then
    down; the two RMSNorm weights. With the model's shapes: n_heads, n_kv_heads, head_dim."""
    w_qkv: torch.Tensor
    wo: torch.Tensor
    w_gate_up: torch.Tensor
    w_down: torch.Tensor
    attn_norm: torch.Tensor
    mlp_norm: torch.Tensor
    n_heads: int
    n_kv_heads: int
    head_dim: int


def random_layers(dev: Device, model, n: int) -> list[Layer]:
    """n layers of `model`'s shapes, random weights scaled by 1/sqrt(fan-in) (activations stay of order 1)."""
    m = tm.get_model(model)
    d, H, Hkv, hd, ff = m.d_model, m.n_heads, m.n_kv_heads, m.head_dim, ffn_width(model)
    return [Layer(w_qkv=dev.randn(d, (H + 2 * Hkv) * hd, scale=d ** -0.5),
                  wo=dev.randn(H * hd, d, scale=(H * hd) ** -0.5), w_gate_up=dev.randn(d, 2 * ff, scale=d ** -0.5),
                  w_down=dev.randn(ff, d, scale=ff ** -0.5), attn_norm=1 + dev.randn(d, scale=0.1),
                  mlp_norm=1 + dev.randn(d, scale=0.1), n_heads=H, n_kv_heads=Hkv, head_dim=hd) for _ in range(n)]


def rope_tables(dev: Device, n_pos: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (n_pos, head_dim) of RoPE's angles at positions 0..n_pos-1 (half-split layout, as
    common/llama.py), made once: an engine keeps them."""
    inv = ROPE_THETA ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    ang = torch.arange(n_pos, dtype=torch.float64)[:, None] * inv
    table = lambda f: torch.cat([f(ang), f(ang)], -1).to(dev.device, dev.dtype)  # noqa: E731
    return table(torch.cos), table(torch.sin)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (..., T, hd) by the angles of its T positions (cos, sin: (T, hd))."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + NORM_EPS) * w


def qkv(layer: Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """x (B, T, d) -> q (B, H, T, hd), k and v (B, Hkv, T, hd), q and k rotated to their positions."""
    B, T, _ = x.shape
    H, Hkv, hd = layer.n_heads, layer.n_kv_heads, layer.head_dim
    q, k, v = (rms_norm(x, layer.attn_norm) @ layer.w_qkv).split([H * hd, Hkv * hd, Hkv * hd], -1)
    q, k = q.view(B, T, H, hd).transpose(1, 2), k.view(B, T, Hkv, hd).transpose(1, 2)
    return rope(q, cos, sin), rope(k, cos, sin), v.view(B, T, Hkv, hd).transpose(1, 2)


def after_attention(layer: Layer, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """The rest of the layer for the rows of x (B, T, d), given their attention a (B, H, T, hd): the output
    projection and the residual, then the residual SwiGLU MLP."""
    B, H, T, hd = a.shape
    x = x + a.transpose(1, 2).reshape(B, T, H * hd) @ layer.wo
    gate, up = (rms_norm(x, layer.mlp_norm) @ layer.w_gate_up).chunk(2, -1)
    return x + (F.silu(gate) * up) @ layer.w_down


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Grouped-query attention of q (B, H, T, hd) over k, v (B, Hkv, S, hd): query head h reads KV head
    h // G (G = H / Hkv). The G heads of a KV head are folded into its rows, (B, Hkv, G*T, hd), so one call of
    scaled_dot_product_attention reads each K, V once; `mask` (G*T, S) is recompute_mask's, folded the same way
    (None: every key is seen)."""
    B, H, T, hd = q.shape
    Hkv = k.shape[1]
    a = F.scaled_dot_product_attention(q.reshape(B, Hkv, (H // Hkv) * T, hd), k, v, attn_mask=mask)
    return a.reshape(B, H, T, hd)


def recompute_mask(pos: torch.Tensor, n_keys: int, groups: int, dtype, device) -> torch.Tensor:
    """The selective recompute's mask as an additive bias (G*T, n_keys): 0 where the selected token at
    position pos[i] may read key j (j <= pos[i]: keys at or before its own position, wherever it sits among
    the selected), -inf elsewhere; repeated for the G query heads folded into each KV head's rows (attend).
    Made once per request: every layer's recompute reads the same one."""
    allowed = torch.arange(n_keys, device=device)[None, :] <= pos.to(device)[:, None]
    bias = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))
    return bias.repeat(groups, 1)


def prefill_layer(layer: Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """One layer's full prefill of x (B, T, d) at positions 0..T-1: each token attends to the keys at or before
    it (the causal attention kernel). Returns (x out, k, v): the layer's output and its KV."""
    T = x.shape[1]
    q, k, v = qkv(layer, x, cos[:T], sin[:T])
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=layer.n_kv_heads != layer.n_heads)
    return after_attention(layer, x, a), k, v


def recompute_layer(layer: Layer, x: torch.Tensor, pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    mask: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """CacheBlend's selective recompute of one layer (§5.3): x (B, n, d) holds the selected tokens' states at
    positions pos (n,); k_cache, v_cache (B, Hkv, S, hd) the layer's loaded KV of all S tokens. The selected
    tokens' fresh K, V replace theirs in the cache; their queries attend to the whole cache through `mask`
    (recompute_mask: each to the keys at or before its position); only their rows go through the MLP.
    Returns their new states (B, n, d)."""
    q, k, v = qkv(layer, x, cos[pos], sin[pos])
    k_cache.index_copy_(2, pos, k)
    v_cache.index_copy_(2, pos, v)
    return after_attention(layer, x, attend(q, k_cache, v_cache, mask))


def decode_layer(layer: Layer, x: torch.Tensor, at: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """One decode step of one layer: x (B, 1, d) is each sequence's new token at position `at`; its K, V are
    written at `at` in the caches (B, Hkv, >at, hd), and it attends to the keys 0..at (all before it: no mask)."""
    q, k, v = qkv(layer, x, cos[at:at + 1], sin[at:at + 1])
    k_cache[:, :, at:at + 1] = k
    v_cache[:, :, at:at + 1] = v
    return after_attention(layer, x, attend(q, k_cache[:, :, :at + 1], v_cache[:, :, :at + 1]))


def selected_positions(dev: Device, n_tokens: int, ratio: float) -> torch.Tensor:
    """The tokens a selective recompute of `ratio` recomputes: round(ratio x n) of them (at least one), spread at
    random over the context (the time model spreads them evenly: the same attention pairs on average), in
    order."""
    n = max(1, round(ratio * n_tokens))
    g = torch.Generator().manual_seed(n_tokens)
    return torch.randperm(n_tokens, generator=g)[:n].sort().values.to(dev.device)


# ------------------------------------------------------------------------------------------- the studies
@dataclass(frozen=True)
class Timed:
    """One measured quantity: its key (common.gpu_reference.row_key, the reference's and --json's), its words,
    the median seconds (None: it did not fit in the device's memory), the time model's seconds for the GPU row
    (None: the model has no such figure) and, for a copy, the bytes it moved."""
    key: str
    label: str
    seconds: float | None
    model_s: float | None
    nbytes: float | None = None


@dataclass(frozen=True)
class Run:
    """How a study runs: on `dev`, compared with the time model's row `gpu`, each figure the median of `runs`
    timed calls after `warmup`."""
    dev: Device
    gpu: str
    warmup: int
    runs: int

    def time(self, fn) -> float | None:
        """fn's median seconds, or None when the device runs out of memory (the row says so)."""
        try:
            return self.dev.median_s(fn, self.warmup, self.runs)
        except OOM:
            self.dev.free()
            return None


def names(model) -> str:
    return tm.get_model(model).name


def prefill(r: Run, model: str, lengths) -> list[Timed]:
    """A full prefill of each length, every layer (no embedding, no LM head: the time model counts neither)."""
    m, dev = tm.get_model(model), r.dev
    try:
        layers = random_layers(dev, model, m.n_layers)
    except OOM:
        dev.free()
        return [Timed(row_key("prefill", model, n), f"{n:,} tokens", None,
                      tm.prefill_time(model, r.gpu, n)) for n in lengths]
    cos, sin = rope_tables(dev, max(lengths), m.head_dim)
    out = []
    for n in lengths:
        x = dev.randn(1, n, m.d_model)

        def run():
            h = x
            for layer in layers:
                h = prefill_layer(layer, h, cos, sin)[0]
            return h

        out.append(Timed(row_key("prefill", model, n), f"{n:,} tokens", r.time(run),
                         tm.prefill_time(model, r.gpu, n)))
        del x
    del layers
    dev.free()
    return out


def one_layer(r: Run, model: str, lengths, ratio: float) -> list[Timed]:
    """One layer at each length: its full prefill, its selective recompute of `ratio` of the tokens against the
    loaded cache, and its KV (K and V of every token) copied from pinned CPU memory."""
    m, dev = tm.get_model(model), r.dev
    layer = random_layers(dev, model, 1)[0]
    cos, sin = rope_tables(dev, max(lengths), m.head_dim)
    out = []
    for n in lengths:
        x = dev.randn(1, n, m.d_model)
        pos = selected_positions(dev, n, ratio)
        x_sel = dev.randn(1, len(pos), m.d_model)
        k_cache, v_cache = dev.randn(1, m.n_kv_heads, n, m.head_dim), dev.randn(1, m.n_kv_heads, n, m.head_dim)
        mask = recompute_mask(pos, n, m.n_heads // m.n_kv_heads, dev.dtype, dev.device)
        host, kv = dev.host((2, 1, m.n_kv_heads, n, m.head_dim), pinned=True), dev.empty((2, 1, m.n_kv_heads, n,
                                                                                           m.head_dim))
        nbytes = host.numel() * host.element_size()
        where = f"{names(model)}, {n:,}"
        out += [Timed(row_key("layer", model, n), f"{where}: full layer",
                      r.time(lambda: prefill_layer(layer, x, cos, sin)), tm.prefill_layer_time(model, r.gpu, n)),
                Timed(row_key("recompute", model, n), f"{where}: {ratio:.0%} recompute",
                      r.time(lambda: recompute_layer(layer, x_sel, pos, k_cache, v_cache, mask, cos, sin)),
                      tm.recompute_time(model, r.gpu, n, ratio) / m.n_layers),
                Timed(row_key("layer_kv", model, n, memory="pinned"), f"{where}: the layer's KV, pinned",
                      r.time(lambda: kv.copy_(host, non_blocking=True)), nbytes / tm.GPUS[r.gpu].pcie_bw, nbytes)]
        del x, x_sel, k_cache, v_cache, mask, host, kv
    del layer
    dev.free()
    return out


def kv_copy(r: Run, model: str, n: int) -> list[Timed]:
    """Every layer's KV of n tokens copied from CPU memory to the device: from pinned and from pageable memory,
    in one copy and layer by layer. The time model has one host-link rate (its pcie_bw), a pinned copy's."""
    m, dev = tm.get_model(model), r.dev
    shape = (m.n_layers, 2, n, m.n_kv_heads, m.head_dim)
    target = dev.empty(shape)
    nbytes = target.numel() * target.element_size()
    model_s = nbytes / tm.GPUS[r.gpu].pcie_bw
    out = []
    for memory in ("pinned", "pageable"):
        host = dev.host(shape, pinned=memory == "pinned")

        def by_layer():
            for i in range(m.n_layers):
                target[i].copy_(host[i], non_blocking=True)

        out += [Timed(row_key("kv", model, n, memory=memory), f"{memory}, one copy",
                      r.time(lambda: target.copy_(host, non_blocking=True)), model_s if memory == "pinned" else None,
                      nbytes),
                Timed(row_key("kv", model, n, memory=memory, per_layer=True),
                      f"{memory}, {m.n_layers} copies (a layer each)",
                      r.time(by_layer), model_s if memory == "pinned" else None, nbytes)]
        del host
    del target
    dev.free()
    return out


def decode(r: Run, model: str, context: int, batches) -> list[Timed]:
    """One decode step of each batch of sequences `context` tokens long: every layer (no LM head), each new
    token's K, V appended to its sequence's cache."""
    m, dev = tm.get_model(model), r.dev
    try:
        layers = random_layers(dev, model, m.n_layers)
    except OOM:
        dev.free()
        return [Timed(row_key("decode", model, context, batch=b), f"batch {b}", None,
                      tm.decode_time_per_token(model, r.gpu, context, b)) for b in batches]
    cos, sin = rope_tables(dev, context + 1, m.head_dim)
    out = []
    for b in batches:
        seconds = None
        try:
            caches = [(dev.randn(b, m.n_kv_heads, context + 1, m.head_dim),
                       dev.randn(b, m.n_kv_heads, context + 1, m.head_dim)) for _ in range(m.n_layers)]
            x = dev.randn(b, 1, m.d_model)

            def step():
                h = x
                for layer, (k, v) in zip(layers, caches):
                    h = decode_layer(layer, h, context, k, v, cos, sin)
                return h

            seconds = r.time(step)
            del caches, x
        except OOM:
            pass
        dev.free()
        out.append(Timed(row_key("decode", model, context, batch=b), f"batch {b}", seconds,
                         tm.decode_time_per_token(model, r.gpu, context, b)))
    del layers
    dev.free()
    return out


def pipeline_model_s(model, gpu: str, n: int, ratio: float) -> tuple[float, float]:
    """(serial, pipelined) seconds on the time model for §5.4 over every layer: each layer's KV load (its bytes
    over the host link) and its recompute of `ratio`. Serial: L x (load + recompute). Pipelined on two
    streams: loading_controller.streamed_s."""
    m = tm.get_model(model)
    load = tm.kv_bytes_per_token(m) / m.n_layers * n / tm.GPUS[gpu].pcie_bw
    rec = tm.recompute_time(model, gpu, n, ratio) / m.n_layers
    return m.n_layers * (load + rec), lc.streamed_s(m.n_layers, load, rec)


def pipeline(r: Run, model: str, lengths, ratio: float) -> list[Timed]:
    """§5.4 over every layer of `model`: each layer's KV copied from pinned CPU memory, then its `ratio`
    recomputed against it; one after the other on one stream, against the loads enqueued on a second stream,
    each layer's recompute waiting only for its own layer's load (so layer l + 1 loads while layer l
    recomputes). On the CPU (--tiny) both run in order."""
    m, dev = tm.get_model(model), r.dev
    try:
        layers = random_layers(dev, model, m.n_layers)
    except OOM:
        dev.free()
        return [Timed(row_key("pipeline", model, n, schedule=s), f"{n:,} tokens: {s}", None, t)
                for n in lengths for s, t in zip(("serial", "pipelined"), pipeline_model_s(model, r.gpu, n, ratio))]
    cos, sin = rope_tables(dev, max(lengths), m.head_dim)
    load_stream, out = dev.stream(), []
    for n in lengths:
        serial_s = pipelined_s = None
        try:
            shape = (m.n_layers, 2, 1, m.n_kv_heads, n, m.head_dim)
            host, kv = dev.host(shape, pinned=True), dev.empty(shape)
            pos = selected_positions(dev, n, ratio)
            x = dev.randn(1, len(pos), m.d_model)
            mask = recompute_mask(pos, n, m.n_heads // m.n_kv_heads, dev.dtype, dev.device)

            def serial():
                h = x
                for i, layer in enumerate(layers):
                    kv[i].copy_(host[i], non_blocking=True)
                    h = recompute_layer(layer, h, pos, kv[i, 0], kv[i, 1], mask, cos, sin)
                return h

            def pipelined():
                if load_stream is None:
                    return serial()
                compute = torch.cuda.current_stream()
                load_stream.wait_stream(compute)           # the last run's recomputes are done with the buffers
                loaded = [torch.cuda.Event() for _ in layers]
                with dev.on(load_stream):
                    for i, done in enumerate(loaded):
                        kv[i].copy_(host[i], non_blocking=True)
                        done.record(load_stream)
                h = x
                for i, layer in enumerate(layers):
                    compute.wait_event(loaded[i])          # layer i's KV is in; later layers still loading
                    h = recompute_layer(layer, h, pos, kv[i, 0], kv[i, 1], mask, cos, sin)
                compute.wait_stream(load_stream)
                return h

            serial_s, pipelined_s = r.time(serial), r.time(pipelined)
            del host, kv, x, mask
        except OOM:
            pass
        dev.free()
        model_serial, model_pipelined = pipeline_model_s(model, r.gpu, n, ratio)
        out += [Timed(row_key("pipeline", model, n, schedule="serial"), f"{n:,} tokens: load, then recompute",
                      serial_s, model_serial),
                Timed(row_key("pipeline", model, n, schedule="pipelined"), f"{n:,} tokens: pipelined (2 streams)",
                      pipelined_s, model_pipelined)]
    del layers
    dev.free()
    return out


def matmul(r: Run, n: int) -> Timed:
    """One n x n by n x n matmul: the device's dense BF16 rate, against the time model's (its datasheet peak
    times the MFU it fitted to the handout's prefill)."""
    a, b = r.dev.randn(n, n), r.dev.randn(n, n)
    seconds = r.time(lambda: a @ b)
    del a, b
    r.dev.free()
    return Timed(row_key("matmul", tokens=n), f"matmul {n:,} x {n:,} x {n:,}", seconds,
                 2 * n ** 3 / (tm.GPUS[r.gpu].bf16_flops * tm.MFU))


def share(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or not b or math.isnan(a) else a / b


# ------------------------------------------------------------------------------------------- the whole check
@dataclass(frozen=True, kw_only=True)
class Results:
    device: str
    torch: str
    dtype: str
    timer: str
    matmul: Timed
    prefill: list
    layers: dict                    # model -> its one_layer rows
    kv: list
    decode: list
    pipeline: list

    def all(self) -> list[Timed]:
        return [self.matmul, *self.prefill, *(t for rows in self.layers.values() for t in rows), *self.kv,
                *self.decode, *self.pipeline]


def check(r: Run, *, matmul_n: int, prefill_model: str, prefill_tokens, layer_models, layer_tokens, ratio: float,
          kv_model: str, kv_tokens: int, decode_model: str, decode_context: int, decode_batches, pipeline_model: str,
          pipeline_tokens) -> Results:
    """Every study, one after another, each given the device's memory back when it ends."""
    mm = matmul(r, matmul_n)
    return Results(device=r.dev.name, torch=torch.__version__, dtype=str(r.dev.dtype).removeprefix("torch."),
                   timer=r.dev.timer, matmul=mm, prefill=prefill(r, prefill_model, prefill_tokens),
                   layers={m: one_layer(r, m, layer_tokens, ratio) for m in layer_models},
                   kv=kv_copy(r, kv_model, kv_tokens), decode=decode(r, decode_model, decode_context, decode_batches),
                   pipeline=pipeline(r, pipeline_model, pipeline_tokens, ratio))
