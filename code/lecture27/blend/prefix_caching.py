"""Prefix caching is not enough (handout §5.1): a RAG input is k retrieved chunks and a question, in a new
combination and order each time, so at most the first chunk is a prefix some earlier request computed.
Prefix caching (RadixAttention, vLLM's automatic prefix caching) reuses only that leading part, exactly;
full KV reuse and CacheBlend reuse every chunk wherever it sits. "The more chunks, the less prefix
caching saves."

Four ways to the first token of [chunk 1 .. chunk k | question], the chunks' KV stored beforehand:
  full prefill     everything computed (the reference)
  prefix caching   chunk 1's KV loaded (it is the prefix), chunks 2..k and the question prefilled after it
  full reuse       every chunk's KV loaded, only the question computed
  CacheBlend r     every chunk's KV loaded, r of the context recomputed (blend_world.blend)

    time_model   on the time model (common/timemodel.py; the reads and the pipeline of loading_controller.py):
                 TTFT and the share of full prefill's GPU time each method saves, k = 1..10 (04, §5.1)
    measured     on SmolLM2-135M on this CPU: wall-clock TTFT on one thread and the first answer token's KL
                 to full prefill, k = 2, 4, 6 built-in passages; CacheBlend under each attention mask
                 given (mask_pitfall.MASKS: blend's own, then the pitfall's). Cached.
Prefix caching's KL is zero up to rounding: the first chunk's stored KV is what a full prefill computes
for it (causal attention: the first tokens never see what follows).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from lecture27 import blend_world as bw
from lecture27 import loading_controller as lc
from common import timemodel as tm
from common.clock import timed


def cpu_timed(fn):
    """(fn(), seconds of CPU time this process spent in it): on one torch thread what an idle core would take;
    a shared machine's waits for a core would otherwise be cached with the result."""
    return timed(fn, time.process_time)


# ============================================================================ on the time model
@dataclass(frozen=True, kw_only=True)
class SystemPrefix:
    """One (model, GPUs) system, lists over k: TTFT of each method in seconds (the three that load KV per
    device: {device: list}), and the share of full prefill's GPU time each method does not spend."""
    model: str
    n_gpus: int
    full_ttft_s: list
    prefix_ttft_s: dict
    reuse_ttft_s: dict
    blend_ttft_s: dict
    prefix_saved_share: list
    reuse_saved_share: list
    blend_saved_share: list


@dataclass(frozen=True, kw_only=True)
class PrefixStudy:
    """§5.1 on the time model: k chunks of chunk_tokens + a question of `question` tokens on `gpu`;
    CacheBlend recomputes `ratio`; systems: model -> SystemPrefix."""
    ks: list
    chunk_tokens: int
    question: int
    gpu: str
    ratio: float
    devices: list
    systems: dict


def system_prefix(model: str, n_gpus: int, gpu: str, devices: dict, ks, chunk_tokens: int, question: int,
                  ratio: float) -> SystemPrefix:
    """TTFT and saved GPU time per k. Every method that loads KV pipelines it as Part 4 does (each layer
    max(read, compute), loading_controller.pipelined_ttft), then prefills the question after the context:
      prefix caching   read chunk 1's layer  || prefill chunks 2..k of that layer after it
      full reuse       read all k chunks' layer (nothing else to compute)
      CacheBlend       read all k chunks' layer || recompute `ratio` of the layer (timemodel.recompute_time)
    GPU time spent: prefix caching prefills (k-1) chunks after one and the question; full reuse only the
    question; CacheBlend the recompute and the question; full prefill everything."""
    L, c = tm.get_model(model).n_layers, chunk_tokens
    full, pre, reuse, blend = [], {d: [] for d in devices}, {d: [] for d in devices}, {d: [] for d in devices}
    saved = {"prefix": [], "reuse": [], "blend": []}
    for k in ks:
        n_ctx = k * c
        full_s = tm.prefill_time(model, gpu, n_ctx + question, 0, n_gpus)
        q_s = tm.prefill_time(model, gpu, question, n_ctx, n_gpus)
        rest_layer = tm.prefill_layer_time(model, gpu, n_ctx - c, c, n_gpus)
        recompute = tm.recompute_time(model, gpu, n_ctx, ratio, n_gpus)
        full.append(full_s)
        for d in devices:
            pre[d].append(lc.pipelined_ttft(L, lc.load_time(model, c, d, n_gpus, devices), rest_layer, q_s))
            load = lc.load_time(model, n_ctx, d, n_gpus, devices)
            reuse[d].append(lc.pipelined_ttft(L, load, 0.0, q_s))
            blend[d].append(lc.pipelined_ttft(L, load, recompute / L, q_s))
        saved["prefix"].append(1 - (L * rest_layer + q_s) / full_s)
        saved["reuse"].append(1 - q_s / full_s)
        saved["blend"].append(1 - (recompute + q_s) / full_s)
    return SystemPrefix(model=model, n_gpus=n_gpus, full_ttft_s=full, prefix_ttft_s=pre, reuse_ttft_s=reuse,
                        blend_ttft_s=blend, prefix_saved_share=saved["prefix"], reuse_saved_share=saved["reuse"],
                        blend_saved_share=saved["blend"])


def time_model(systems, gpu: str, devices: dict, ks, chunk_tokens: int, question: int, ratio: float) -> PrefixStudy:
    """§5.1 for each (model, n_gpus) of `systems`; devices: name -> (how, bytes/s) as loading_controller.load_time
    reads them (the tiers the chunks' KV is kept in)."""
    return PrefixStudy(ks=list(ks), chunk_tokens=chunk_tokens, question=question, gpu=gpu, ratio=ratio,
                       devices=list(devices),
                       systems={m: system_prefix(m, g, gpu, devices, ks, chunk_tokens, question, ratio)
                                for m, g in systems})


# ============================================================================ measured on SmolLM2
def key_chunks(k: int) -> tuple[int, int]:
    """Where the item's two key passages open, among k chunks: chunks 1 and k - 2 (04's Part 5 input, 1 and
    4, at k = 6), chunks 0 and 1 at k = 2; never chunk 0 when there is room, so it is not the only prefix."""
    return (0, 1) if k == 2 else (1, max(2, k - 2))


@dataclass(frozen=True, kw_only=True)
class Measured:
    """SmolLM2 on this CPU, lists over k: TTFT in seconds (median over the items, CPU time of one torch thread,
    chunks' KV in memory) and the first answer token's KL(full prefill || method) in nats (mean over the items).
    mask_kl: CacheBlend's KL under each attention mask measured (name -> list over k); blend_kl is the
    first mask's (blend's own). n_tokens: context + question tokens of the first item, per k."""
    ks: list
    n_items: int
    chunk_tokens: int
    rule: str
    ratio: float
    n_tokens: list
    full_ttft_s: list
    prefix_ttft_s: list
    reuse_ttft_s: list
    blend_ttft_s: list
    prefix_kl: list
    reuse_kl: list
    blend_kl: list
    mask_kl: dict
    loaded: bool
    compute_seconds: float

    @property
    def prefix_saved_share(self) -> list:
        """Share of full prefill's measured TTFT that prefix caching does not spend, per k."""
        return [1 - p / f for p, f in zip(self.prefix_ttft_s, self.full_ttft_s)]

    @property
    def blend_saved_share(self) -> list:
        return [1 - b / f for b, f in zip(self.blend_ttft_s, self.full_ttft_s)]


def first_chunk(pre, rd):
    """The stored KV of the shared prefix and the first chunk: what prefix caching can reuse."""
    from lecture27.blend_world import chunk_spans
    from common.llama import KVCache

    n = chunk_spans(rd.chunks)[0][1]
    return KVCache([k[:, :, :n] for k in pre.k], [v[:, :, :n] for v in pre.v], pre.pos[:n]), n


@torch.no_grad()
def measure_one(model, rd, rule, ratio: float, masks: dict) -> dict:
    """One RAG input: each method's TTFT on one thread (CPU time, cpu_timed; the chunks' KV prefilled before,
    untimed, as a store holds them; placing them, each chunk's K shifted to its place, timed for the two methods
    that place every chunk, as kvstore.assemble places fetched chunks) and its first answer token's KL to full
    prefill; CacheBlend once per mask of `masks`."""
    from common.llama import kl_divergence, place_chunks, single_thread

    stored = bw.stored_chunks(model, rd.doc, rd.chunks)
    lp = lambda lg: lg[0, -1].log_softmax(-1)  # noqa: E731
    with single_thread():
        (lg, _), t_full = cpu_timed(lambda: model(rd.tokens, last=True))
        pre, t_shift = cpu_timed(lambda: place_chunks(stored, model.cfg.rope_theta))
        head, n = first_chunk(pre, rd)
        rest = torch.cat([rd.doc[:, n:], rd.question], 1)
        (lg_prefix, _), t_prefix = cpu_timed(lambda: model(rest, cache=head, last=True))
        (lg_reuse, _), t_reuse = cpu_timed(lambda: model(rd.question, cache=pre, last=True))
        blends = {}
        for name, mask in masks.items():
            blends[name] = cpu_timed(lambda: bw.blend(model, rd, rd.chunks, ratio, rule=rule, pre=pre, mask=mask))
    full = lp(lg)
    kl = lambda lg: float(kl_divergence(full, lp(lg)))  # noqa: E731
    first = next(iter(masks))
    return {"ttft": {"full": t_full, "prefix": t_prefix, "reuse": t_shift + t_reuse,
                     "blend": t_shift + blends[first][1]},
            "kl": {"prefix": kl(lg_prefix), "reuse": kl(lg_reuse),
                   **{f"blend {m}": kl(b[0]) for m, b in blends.items()}},
            "n_tokens": rd.tokens.shape[1]}


def measured(model, tok, model_id: str, items: int, ks, chunk_tokens: int, rule_name: str, ratio: float,
             masks: dict, recompute: bool = False, progress: bool = True) -> Measured:
    """§5.1 on SmolLM2: the first `items` built-in RAG items, each cut into k chunks of chunk_tokens (the key
    passages where key_chunks says) for each k of `ks`; CacheBlend with blend_rules.RULES[rule_name] at
    `ratio`, once per mask of `masks` (name -> mask; the first is blend's own). Cached with
    checkpoints.cached_result (inputs: the model file, the inputs' tokens, the methods; and the code);
    `recompute` measures again. The TTFT is cached with the KL: it is a measurement of the run that made it."""
    from lecture27.blend import rag as blend_rag
    from lecture27 import blend_rules
    from tqdm import tqdm

    from common.checkpoints import cached_result
    from common.english import RAG_ITEMS, rag_chunks

    rags = {k: [rag_chunks(it, tok, n_chunks=k, chunk_tokens=chunk_tokens, key_chunks=key_chunks(k))
                for it in RAG_ITEMS[:items]] for k in ks}
    blend_rag.check_context(model, [r for k in ks for r in rags[k]])
    ident = {"model": model_id, "ks": list(ks), "rule": rule_name, "ratio": ratio,
             "masks": list(masks), "inputs": blend_rag.inputs_digest([r for k in ks for r in rags[k]])}

    def compute():
        todo = [(k, r) for k in ks for r in rags[k]]
        runs = [measure_one(model, bw.rag_doc(r), blend_rules.RULES[rule_name], ratio, masks)
                for k, r in tqdm(todo, desc="SmolLM2, prefix caching vs reuse", disable=not progress)]
        return {"runs": [{"k": k, **run} for (k, _), run in zip(todo, runs)]}

    computed = []
    res = cached_result("prefix-smollm2", ident, lambda: computed.append(1) or compute(), refit=recompute,
                        tag="04", flag="--recompute")
    by_k = {k: [r for r in res["runs"] if r["k"] == k] for k in ks}
    ttft = lambda m: [statistics.median(r["ttft"][m] for r in by_k[k]) for k in ks]  # noqa: E731
    kl = lambda m: [statistics.fmean(r["kl"][m] for r in by_k[k]) for k in ks]  # noqa: E731
    mask_kl = {m: kl(f"blend {m}") for m in masks}
    return Measured(ks=list(ks), n_items=items, chunk_tokens=chunk_tokens, rule=rule_name, ratio=ratio,
                    n_tokens=[by_k[k][0]["n_tokens"] for k in ks], full_ttft_s=ttft("full"),
                    prefix_ttft_s=ttft("prefix"), reuse_ttft_s=ttft("reuse"), blend_ttft_s=ttft("blend"),
                    prefix_kl=kl("prefix"), reuse_kl=kl("reuse"), blend_kl=mask_kl[next(iter(masks))],
                    mask_kl=mask_kl, loaded=not computed, compute_seconds=res["compute_seconds"])
