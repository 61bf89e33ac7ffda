"""The time model: how long a GPU takes to prefill, recompute and decode (the "lecture 26" model).

Two tables (GPUS, MODELS) and a few functions. Every hardware or model constant carries a one-line
source. The model is a roofline with two efficiency constants, both fitted in closed form to the
handout's anchors at import time (see `_fit` at the bottom):

  MFU                 fraction of peak dense BF16 FLOP/s that prefill achieves. Fitted to
                      ANCHOR_1GPU: LLaMA-3.1-8B, 12K tokens on one H100 = 0.36 s (no communication).
  TP_COMM_EFFICIENCY  fraction of the GPU-to-GPU link bandwidth that tensor-parallel all-reduces
                      achieve (not overlapped with compute). Fitted to ANCHOR_TP, given MFU:
                      LLaMA-3.1-70B, 16K tokens on 8 x H100 = 0.97 s.

Every other time (other models, GPUs, lengths, chunks, recompute ratios) follows from these.
This machine's CPU is a device too (`cpu_device`), calibrated instead by one prefill measured on it.

Prefill of n_new tokens after n_cached cached ones, per layer:
  linear FLOPs    = 2 * (active params of the layer's matmuls) * n_new
  attention FLOPs = 2 * n_heads * (qk_dim + v_dim) * pairs,  pairs = n_new*n_cached + n_new(n_new+1)/2
                    (Q.K^T and P.V for every (query, earlier-or-same key) pair; causal, so masked
                    pairs are not counted; 2*H*(hd+hd) = 4*d_attn for ordinary attention)
  compute time    = FLOPs / (n_gpus * peak * MFU)
  TP comm time    = 2 all-reduces (after attention, after the MLP) of the n_new x d_model BF16
                    activations; a ring all-reduce moves 2(n-1)/n of the message over each GPU's link
  layer time      = compute + comm
Not counted: embeddings and the LM head (one token's logits), norms, RoPE, softmax (all small), and
per-call overheads (kernel launches, scheduling).

Decode is memory-bound: one step reads the weights (split over the GPUs) and every sequence's KV
(split over min(n_gpus, n_kv_heads) GPUs) from HBM at the datasheet bandwidth (no fitted constant:
no decode anchor; real kernels reach ~80% of it, so this is a lower bound).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True)
class GPU:
    name: str
    bf16_flops: float   # dense BF16 tensor FLOP/s (no sparsity)
    hbm_bw: float       # HBM bytes/s
    hbm_bytes: float    # HBM capacity, bytes
    link_bw: float      # GPU-to-GPU bytes/s per direction per GPU (NVLink / Infinity Fabric)
    pcie_bw: float      # host link bytes/s per direction


GPUS = {
    # NVIDIA H100 SXM5 datasheet: 989 TFLOPS BF16 dense, 3.35 TB/s HBM3, 80 GB, NVLink 900 GB/s (bidir),
    # PCIe Gen5 128 GB/s (bidir)
    "H100": GPU("H100 SXM", 989.4e12, 3.35e12, 80e9, 450 * GB, 64 * GB),
    # NVIDIA H200 SXM datasheet: same compute as H100, 4.8 TB/s HBM3e, 141 GB, NVLink 900 GB/s, PCIe Gen5
    "H200": GPU("H200 SXM", 989.4e12, 4.8e12, 141e9, 450 * GB, 64 * GB),
    # NVIDIA A100 80GB SXM datasheet: 312 TFLOPS BF16, 2,039 GB/s HBM2e, NVLink 600 GB/s (bidir),
    # PCIe Gen4 64 GB/s (bidir)
    "A100-80GB": GPU("A100 80GB SXM", 312e12, 2.039e12, 80e9, 300 * GB, 32 * GB),
    # NVIDIA A40 datasheet: 149.7 TFLOPS BF16 dense, 696 GB/s GDDR6, 48 GB, PCIe Gen4 x16;
    # its NVLink bridge joins only pairs, so tensor parallelism over >2 GPUs runs over PCIe (32 GB/s each way)
    "A40": GPU("A40", 149.7e12, 696e9, 48e9, 32 * GB, 32 * GB),
    # AMD MI300X datasheet: 1,307.4 TFLOPS BF16 dense, 5.3 TB/s HBM3, 192 GB, 7 x 64 GB/s Infinity Fabric each
    # way, PCIe Gen5
    "MI300X": GPU("MI300X", 1307.4e12, 5.3e12, 192e9, 448 * GB, 64 * GB),
}


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    name: str
    n_layers: int
    d_model: int
    n_heads: int            # query heads
    n_kv_heads: int         # K/V heads cached per layer (= n_heads: multi-head; < n_heads: GQA)
    head_dim: int           # per-head width of Q.K and of V
    linear_params: float    # active parameters in the layers' matmuls (no embeddings, no LM head)
    total_params: float     # all parameters (weights read by decode)
    active_params: float    # parameters used per token (= total for dense models)
    kv_latent: int = 0      # MLA: width cached per layer per token (latent + shared RoPE key); 0 = K and V
    qk_dim: int = 0         # MLA: per-head Q.K width when it differs from head_dim
    tag: str = ""

    @property
    def attn_pair_flops(self) -> float:
        """FLOPs per (query, key) pair per layer: Q.K^T (2*qk) and P.V (2*v) for every head."""
        return 2 * self.n_heads * ((self.qk_dim or self.head_dim) + self.head_dim)


def _dense(name, L, d, H, Hkv, hd, d_ff, vocab, tied=False, tag=""):
    """A LLaMA-style dense model: parameters follow from the shapes."""
    per_layer = d * H * hd + 2 * d * Hkv * hd + H * hd * d + 3 * d * d_ff  # Wq, Wk+Wv, Wo, SwiGLU
    linear = L * per_layer
    total = linear + vocab * d * (1 if tied else 2) + (2 * L + 1) * d  # + embeddings (+ LM head) + norms
    return ModelSpec(name=name, n_layers=L, d_model=d, n_heads=H, n_kv_heads=Hkv, head_dim=hd, linear_params=linear,
                     total_params=total, active_params=total, tag=tag)


def _moe(name, L, d, H, Hkv, hd, vocab, total, active, kv_latent=0, qk_dim=0, tag=""):
    """An MoE model: active and total parameters from the model card; embedding + LM head removed."""
    linear = active - 2 * vocab * d
    return ModelSpec(name=name, n_layers=L, d_model=d, n_heads=H, n_kv_heads=Hkv, head_dim=hd, linear_params=linear,
                     total_params=total, active_params=active, kv_latent=kv_latent, qk_dim=qk_dim, tag=tag)


MODELS = {
    # Meta model card / config.json: 32 layers, d 4096, 32 heads, 8 KV heads, head 128, FFN 14336, vocab 128256
    "llama-3.1-8b": _dense("LLaMA-3.1-8B", 32, 4096, 32, 8, 128, 14336, 128256, tag="GQA"),
    # Meta config.json: 80 layers, d 8192, 64 heads, 8 KV heads, head 128, FFN 28672, vocab 128256
    "llama-3.1-70b": _dense("LLaMA-3.1-70B", 80, 8192, 64, 8, 128, 28672, 128256, tag="GQA"),
    # Meta LLaMA-2 config.json: 32 layers, d 4096, 32 heads, multi-head (32 KV heads), FFN 11008, vocab 32000
    "llama-2-7b": _dense("LLaMA-2-7B", 32, 4096, 32, 32, 128, 11008, 32000, tag="MHA"),
    # Meta LLaMA-3 config.json: same shapes as LLaMA-3.1-8B (8K context)
    "llama-3-8b": _dense("LLaMA-3-8B", 32, 4096, 32, 8, 128, 14336, 128256, tag="GQA"),
    # Qwen3-235B-A22B config.json: 94 layers, d 4096, 64 heads, 4 KV heads, head 128, vocab 151936;
    # card: 235B total, 22B active
    "qwen3-235b-a22b": _moe("Qwen3-235B-A22B", 94, 4096, 64, 4, 128, 151936, 235e9, 22e9, tag="GQA, MoE"),
    # DeepSeek-V3/R1 config.json: 61 layers, d 7168, 128 heads, MLA kv_lora_rank 512 + qk_rope 64,
    # qk_nope 128 (+64 rope = 192 per head for Q.K), v_head 128, vocab 129280; paper: 671B total, 37B active
    "deepseek-r1": _moe("DeepSeek-R1", 61, 7168, 128, 1, 128, 129280, 671e9, 37e9,
                        kv_latent=512 + 64, qk_dim=192, tag="MLA, MoE"),
    # this lecture's two small LLaMAs (common.city.city_config, blend_world.model_config): 4 layers, d 64,
    # 4 heads, 2 KV heads, head 16, FFN 192; vocabularies: city language 72 words, record world 29 tokens
    "city": _dense("city LLaMA", 4, 64, 4, 2, 16, 192, 72, tied=True, tag="GQA, lecture 19"),
    "record": _dense("record world", 4, 64, 4, 2, 16, 192, 29, tied=True, tag="GQA, blend_world"),
}


def get_model(model) -> ModelSpec:
    return MODELS[model] if isinstance(model, str) else model


def get_gpu(gpu) -> GPU:
    return GPUS[gpu] if isinstance(gpu, str) else gpu


# ------------------------------------------------------------------------------------------ KV size
SERVED_BYTES_PER_VALUE = 2   # the models above are served in BF16: their weights and KV, 2 bytes a value


def kv_bytes_per_token(model, bytes_per_value=SERVED_BYTES_PER_VALUE) -> int:
    """Bytes of KV one token leaves in the cache, all layers (in BF16 unless told otherwise).
    GQA / multi-head: K and V, each n_kv_heads * head_dim values per layer.
    MLA (DeepSeek): one latent vector + one shared RoPE key per layer (kv_latent values)."""
    m = get_model(model)
    per_layer = m.kv_latent if m.kv_latent else 2 * m.n_kv_heads * m.head_dim
    return int(m.n_layers * per_layer * bytes_per_value)


# ------------------------------------------------------------------------------------------ prefill
def _layer_flops(m: ModelSpec, n_new: float, pairs: float) -> float:
    return 2 * (m.linear_params / m.n_layers) * n_new + m.attn_pair_flops * pairs


def _layer_comm_s(m: ModelSpec, g: GPU, n_new: float, n_gpus: int, comm_eff: float) -> float:
    if n_gpus == 1:
        return 0.0
    message = n_new * m.d_model * 2  # BF16 activations
    return 2 * (2 * (n_gpus - 1) / n_gpus) * message / (g.link_bw * comm_eff)


def _layer_time(m, g, n_new, pairs, n_gpus, mfu, comm_eff):
    return (_layer_flops(m, n_new, pairs) / (n_gpus * g.bf16_flops * mfu)
            + _layer_comm_s(m, g, n_new, n_gpus, comm_eff))


def causal_pairs(n_new: float, n_cached: float = 0) -> float:
    """(query, key) pairs when n_new tokens follow n_cached ones: the i-th new token sees n_cached + i keys."""
    return n_new * n_cached + n_new * (n_new + 1) / 2


def prefill_layer_time(model, gpu, n_new, n_cached=0, n_gpus=1) -> float:
    """Seconds for one layer to prefill n_new tokens whose queries also attend to n_cached cached tokens."""
    m, g = get_model(model), get_gpu(gpu)
    return _layer_time(m, g, n_new, causal_pairs(n_new, n_cached), n_gpus, MFU, TP_COMM_EFFICIENCY)


def prefill_time(model, gpu, n_new, n_cached=0, n_gpus=1) -> float:
    """Seconds to prefill n_new tokens after n_cached cached ones (all layers).
    n_cached=0 is a full prefill; a chunk of a longer context is (chunk, tokens before it). With no
    per-call overhead in the model, prefilling a context chunk by chunk costs exactly as much as at once
    (e.g. CacheGen's text fallback: recompute chunk i given the KV of chunks 0..i-1 already received)."""
    return get_model(model).n_layers * prefill_layer_time(model, gpu, n_new, n_cached, n_gpus)


def recompute_time(model, gpu, n_ctx, ratio, n_gpus=1) -> float:
    """Seconds to recompute a fraction `ratio` of an n_ctx-token context (CacheBlend's selective
    recompute). The recomputed tokens still attend to every context token before them (not just
    their chunk); spread evenly over the context they make `ratio` of a full prefill's attention pairs.
    So recompute_time(..., ratio=1) == prefill_time(..., n_ctx)."""
    m, g = get_model(model), get_gpu(gpu)
    n = ratio * n_ctx
    return m.n_layers * _layer_time(m, g, n, ratio * causal_pairs(n_ctx), n_gpus, MFU, TP_COMM_EFFICIENCY)


# ------------------------------------------------------------------------------------------- decode
def decode_time_per_token(model, gpu, ctx_len, batch=1, n_gpus=1) -> float:
    """Seconds for one decode step (each of `batch` sequences, ctx_len tokens long, gains a token).
    Memory-bound: every step reads the weights once (BF16; an MoE reads at most batch x its active
    experts) and every sequence's KV. Tensor parallelism splits the weights over n_gpus and the KV
    over min(n_gpus, n_kv_heads) GPUs (a KV head, or MLA's single latent, is not split)."""
    m, g = get_model(model), get_gpu(gpu)
    weights = 2 * min(m.total_params, m.active_params * batch)
    kv = kv_bytes_per_token(m) * ctx_len * batch
    return (weights / n_gpus + kv / min(n_gpus, max(m.n_kv_heads, 1))) / g.hbm_bw


# ----------------------------------------------------------------------------------------- this CPU
def dense_model(name: str, cfg, tag: str = "") -> ModelSpec:
    """The ModelSpec of a LLaMA loaded on this machine (a common.llama.LlamaConfig, e.g. SmolLM2's from its
    GGUF): its parameters follow from the shapes, as the table's dense models' do."""
    return _dense(name, cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff,
                  cfg.vocab_size, tied=cfg.tie_embeddings, tag=tag)


def cpu_device(model, n_tokens: int, seconds: float, mem_bw: float = math.inf, name: str = "this CPU") -> GPU:
    """This machine's CPU as a device of the time model, calibrated by ONE measured prefill: a full prefill
    of n_tokens tokens of `model` took `seconds`. Its compute rate is set so that prefill_time gives that
    measurement back (peak = the prefill's FLOPs / (seconds x MFU): the GPUs' fitted MFU cancels out); every
    other time follows from the FLOPs, as on a GPU: CacheBlend's recompute at ratio r, the question after
    a cached context, another length. mem_bw (bytes/s) bounds decode; one device, no links. What the
    model leaves out shows beside a measurement: a CPU runs a short matmul (a few recomputed tokens, the
    question) well below the rate of a long prefill's, and CacheBlend's selection adds steps of its own."""
    m = get_model(model)
    flops = m.n_layers * _layer_flops(m, n_tokens, causal_pairs(n_tokens))
    return GPU(name, flops / (seconds * MFU), mem_bw, math.inf, math.inf, mem_bw)


# -------------------------------------------------------------------------------------- calibration
# The handout's anchors ("the time model of lecture 26"): (model, gpu, tokens, n_gpus, seconds)
ANCHOR_1GPU = ("llama-3.1-8b", "H100", 12 * 1024, 1, 0.36)   # handout §9 pitfall 1 / §4.1
ANCHOR_TP = ("llama-3.1-70b", "H100", 16 * 1024, 8, 0.97)    # handout §10 exercise 2 / §1.4


def _fit():
    """Closed form. One GPU has no communication, so ANCHOR_1GPU fixes MFU:
         t = FLOPs / (peak * MFU)                       ->  MFU = FLOPs / (peak * t)
    With MFU known, ANCHOR_TP's leftover time is the all-reduces:
         t = FLOPs / (n * peak * MFU) + comm_ideal / eff  ->  eff = comm_ideal / (t - compute)"""
    name, gpu, T, n, t = ANCHOR_1GPU
    m, g = MODELS[name], GPUS[gpu]
    flops = m.n_layers * _layer_flops(m, T, causal_pairs(T))
    mfu = flops / (g.bf16_flops * t)

    name, gpu, T, n, t = ANCHOR_TP
    m, g = MODELS[name], GPUS[gpu]
    compute = m.n_layers * _layer_flops(m, T, causal_pairs(T)) / (n * g.bf16_flops * mfu)
    comm_ideal = m.n_layers * _layer_comm_s(m, g, T, n, 1.0)
    if t <= compute:
        raise ValueError("TP anchor is faster than its compute alone: anchors inconsistent")
    return mfu, comm_ideal / (t - compute)


MFU, TP_COMM_EFFICIENCY = _fit()
