"""CacheBlend in the record world (handout §5.2-5.3): the trained record model on held-out documents cut
into chunks. Full reuse loses the records a chunk boundary splits (a key in one chunk, its value in the
next); CacheBlend repairs them by recomputing the tokens that deviate most, random picks of the same size
do not; the deviation is concentrated, adjacent layers rank it alike, and layer 0's picks find it.

    trained          the record model of a seed and locality, and what the cache holds about its training
    record_experiment  accuracy of full prefill, full reuse, CacheBlend and random on split/unsplit records
    input_rules      the rules that read the input first (the question's attention, chunk starts) at r
    split_at         exercise 6: which records a chunk length splits, full reuse against full prefill
    insights         the two insights and layer 0's picks at one chunk length
    curve            split-record accuracy against the recompute ratio, CacheBlend and random (cached)
    findings         Part 3: the insights, the curve, where document tokens attend
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from lecture27.blend_rules import INPUT_RULES, Random
from lecture27.blend_world import (N_RECORDS, PROGRESSIVE, accuracy, answer_correct, answer_slots, blend,
                         full_prefill, full_reuse, heldout, kv_deviation, precompute_chunks, spearman, split_mask,
                         split_records, top_share)
from lecture27.record_trainer import doc_attention_elsewhere, record_model
from common import checkpoints
from common.llama import KVCache

METHODS = ("full", "reuse", "blend", "random")


# ============================================================================ the record world's model (§0.4)
@dataclass(kw_only=True)
class Training:
    """What the cache holds about the record model's training (record_trainer.record_model's metadata)."""
    steps: int
    train_seconds: float
    drop_step: int                  # where the accuracy crossed 50%
    heldout_acc: float
    heldout_questions: int
    locality: float                 # the locality penalty's weight
    locality_from_step: int | None
    loaded: bool                    # this process loaded it from code/checkpoints/ (rather than trained it)
    meta: dict                      # the metadata as cached, for record_trainer.plot_training


def cache_loaded(name: str) -> bool:
    """Did this process load `name` from code/checkpoints/ (rather than compute it)?"""
    return next((e["loaded"] for e in reversed(checkpoints.EVENTS) if e["name"] == name), False)


def trained(retrain: bool, seed: int, locality: float):
    """(model, Training): record_model(...) of this seed and locality; record_trainer.TrainingFailed when
    training fails."""
    model, meta = record_model(retrain, seed, locality=locality)
    m = meta["metrics"]
    return model, Training(steps=m["steps"], train_seconds=m["train_seconds"], drop_step=m["drop_step"],
                           heldout_acc=m["heldout_acc"], heldout_questions=m["heldout_questions"],
                           locality=meta["ident"]["train"]["locality"], locality_from_step=m.get("locality_from_step"),
                           loaded=cache_loaded("records"), meta=meta)


# ============================================================================ §5.2-5.3: records
@dataclass
class Accuracy:
    split: float | None             # None where no record is split
    unsplit: float | None
    all: float


@dataclass(kw_only=True)
class RecordRun:
    rec: object                     # the held-out Records
    pre: KVCache                    # their chunks, precomputed once for Parts 2-3 and exercise 6
    split_ids: list[int]
    n_split: int                    # questions on split records
    acc: dict[str, Accuracy]        # method (METHODS) -> accuracy
    chunk_len: int
    ratio: float
    seed: int
    docs: int
    full: torch.Tensor              # full prefill's logits, for every method and exercise 6 to be measured against
    n_questions: int

    @property
    def n_unsplit(self) -> int:
        return self.n_questions - self.n_split

    def shown(self) -> "RecordRun":
        """The run as its tables read it: without the records, their chunks and full prefill's logits (what the
        later computations need, and what a cached copy need not keep)."""
        return dataclasses.replace(self, rec=None, pre=None, full=None)


def acc_or_none(correct, mask):
    return accuracy(correct, mask) if mask.any() else None


def methods(model, rec, chunk_len: int, ratio: float, seed: int, pre, full) -> dict[str, torch.Tensor]:
    """(B, Q) correctness of each way to prefill, by method (full: full prefill's logits)."""
    g = torch.Generator().manual_seed(seed + 7)
    return {"full": answer_correct(full, rec),
            "reuse": answer_correct(full_reuse(model, rec, chunk_len, pre), rec),
            "blend": answer_correct(blend(model, rec, chunk_len, ratio, pre=pre), rec),
            "random": answer_correct(blend(model, rec, chunk_len, ratio, rule=Random(g), pre=pre), rec)}


def record_experiment(model, docs: int, chunk_len: int, ratio: float, seed: int) -> RecordRun:
    rec = heldout(docs)
    pre, full = precompute_chunks(model, rec.doc, chunk_len), full_prefill(model, rec)
    split = split_mask(rec, chunk_len)
    acc = {m: Accuracy(acc_or_none(ok, split), acc_or_none(ok, ~split), accuracy(ok))
           for m, ok in methods(model, rec, chunk_len, ratio, seed, pre, full).items()}
    return RecordRun(rec=rec, pre=pre, split_ids=split_records(chunk_len), n_split=int(split.sum()), acc=acc,
                     chunk_len=chunk_len, ratio=ratio, seed=seed, docs=docs, full=full,
                     n_questions=rec.answers.numel())


@torch.no_grad()
def input_rules(model, run: RecordRun) -> dict[str, Accuracy]:
    """Accuracy of blend() at the run's ratio with each rule of blend_rules.INPUT_RULES (after its own pass
    over the input: the question's attention over full reuse's cache, or the chunks' first tokens) on
    the run's held-out records. The question asks for one record's value at a time: its attention at
    layers 1.. should find the value it reads."""
    split = split_mask(run.rec, run.chunk_len)
    out = {}
    for name, rule in INPUT_RULES.items():
        rule = rule.ready(model, run.rec, run.chunk_len, run.pre)
        ok = answer_correct(blend(model, run.rec, run.chunk_len, run.ratio, rule=rule, pre=run.pre), run.rec)
        out[name] = Accuracy(acc_or_none(ok, split), acc_or_none(ok, ~split), accuracy(ok))
    return out


# ---------------------------------------------------------------------------- §5.2, exercise 6
@dataclass
class SplitAt:
    chunk_len: int
    split_records: list[int]
    reuse_acc: float                # full reuse, every question
    full_acc: float                 # full prefill, every question
    reuse_equals_full: bool         # full reuse gives full prefill's answer to every question


def split_at(model, run: RecordRun, chunk_len: int) -> SplitAt:
    """The held-out records of Part 2 in chunks of `chunk_len`: which records are split, and full reuse
    against full prefill on every question."""
    rec = run.rec
    pre = run.pre if chunk_len == run.chunk_len else precompute_chunks(model, rec.doc, chunk_len)
    reuse, full = full_reuse(model, rec, chunk_len, pre), run.full   # full prefill does not depend on the chunks
    slots = answer_slots(N_RECORDS)
    same = bool((reuse[:, slots].argmax(-1) == full[:, slots].argmax(-1)).all())
    return SplitAt(chunk_len, split_records(chunk_len), accuracy(answer_correct(reuse, rec)),
                   accuracy(answer_correct(full, rec)), same)


# ============================================================================ §5.3: insights
@dataclass(kw_only=True)
class Insights:
    top_share: float                # share of the deviation held by the top `top` tokens, layers 1..
    top_per_layer: list[float]
    rank_corr: list[float]          # Spearman of the deviation, layers (1, 2), (2, 3), ...
    layer0_vs_layer1: float         # layer 0's attention deviation vs layer 1's KV deviation
    layer0_coverage: float | None   # layer 0's picks covering the chunk-initial values
    first_value_share: list         # chunk-initial values' share of the deviation, per layer 1..
    deviation: torch.Tensor         # (L, B, N)


@dataclass
class Curve:
    ratios: list[float]
    blend: dict[int, list]          # chunk length -> CacheBlend's split-record accuracy per ratio
    random: dict[int, list]


@dataclass
class Findings:
    """Part 3: the insights at the run's chunk length, the compute-quality curve and what it answers."""
    insights: Insights
    curve: Curve
    elsewhere: list[float]          # document tokens' attention on other tokens, per layer
    blend_at_ratio: dict[int, float | None]   # curve chunk length -> CacheBlend at r on split records
    lowest: dict[int, float | None]           # curve chunk length -> lowest ratio recovering `recover`
    recover: float


@torch.no_grad()
def insights(model, rec, chunk_len: int, ratio: float, top: float, pre=None) -> Insights:
    pre = pre if pre is not None else precompute_chunks(model, rec.doc, chunk_len)
    dev = kv_deviation(model, rec, chunk_len, pre)          # (L, B, N)
    L = dev.shape[0]
    per_layer = [top_share(dev[i], top) for i in range(1, L)]
    corr = [spearman(dev[i], dev[i + 1]) for i in range(1, L - 1)]
    _, trace = blend(model, rec, chunk_len, ratio, pre=pre, trace=True)
    corr0 = spearman(trace.attn_dev0, dev[1])                 # layer 0's attention deviation vs layer 1's KV deviation
    # layer 0's picks vs the chunk-initial values (the split records' values)
    firsts = [2 * i + 1 for i in split_records(chunk_len)]
    picks = trace.recomputed[0]
    coverage = float(torch.stack([(picks == p).any(1) for p in firsts], 1).float().mean()) if firsts else None
    first_share = [float(dev[i][:, firsts].sum() / dev[i].sum()) if firsts else None for i in range(1, L)]
    return Insights(top_share=sum(per_layer) / len(per_layer), top_per_layer=per_layer, rank_corr=corr,
                    layer0_vs_layer1=corr0, layer0_coverage=coverage, first_value_share=first_share, deviation=dev)


def curve(model, rec, seed: int, ratios, chunk_lens, pre: dict | None = None) -> Curve:
    """Split-record accuracy against the recompute ratio, CacheBlend and random, per chunk length
    (None where a chunk length splits no record; pre: chunk length -> its precomputed chunks, where
    already at hand)."""
    out = Curve(list(ratios), {}, {})
    for c in chunk_lens:
        pre_c = (pre or {}).get(c)
        pre_c = pre_c if pre_c is not None else precompute_chunks(model, rec.doc, c)
        split = split_mask(rec, c)
        for how, into in (("deviation", out.blend), ("random", out.random)):
            g = torch.Generator().manual_seed(seed + 7)
            rule = Random(g) if how == "random" else PROGRESSIVE
            into[c] = [acc_or_none(answer_correct(blend(model, rec, c, r, rule=rule, pre=pre_c), rec), split)
                       for r in ratios]
    return out


def lowest_ratio(ratios, accs, target: float):
    """The smallest ratio whose accuracy reaches target (None if none does)."""
    return next((r for r, acc in zip(ratios, accs) if acc is not None and acc >= target), None)


def cached_curve(model, run: RecordRun, ratios, chunk_lens) -> Curve:
    """`curve` on the run's held-out records, computed once for this model, seed, ratios and chunk lengths,
    then loaded (19 s of the run)."""
    ident = {"model": getattr(model, "cache_key", None), "docs": run.docs, "seed": run.seed, "ratios": ratios,
             "chunk_lens": list(chunk_lens)}
    return Curve(**checkpoints.cached("curve-records", ident, lambda: dataclasses.asdict(
        curve(model, run.rec, run.seed, ratios, chunk_lens, pre={run.chunk_len: run.pre}))))


def findings(model, run: RecordRun, top: float, curve_ratios, curve_chunk_lens, recover: float) -> Findings:
    """The insights at the run's chunk length, and the compute-quality curve (curve_ratios and the run's r)."""
    ratios = sorted(set(curve_ratios) | {run.ratio})
    c = cached_curve(model, run, ratios, curve_chunk_lens)
    return Findings(insights(model, run.rec, run.chunk_len, run.ratio, top, run.pre), c,
                    doc_attention_elsewhere(model, run.rec),
                    {n: c.blend[n][ratios.index(run.ratio)] for n in curve_chunk_lens},
                    {n: lowest_ratio(ratios, c.blend[n], recover) for n in curve_chunk_lens}, recover)


def lorenz(dev: torch.Tensor) -> torch.Tensor:
    """(B, N) deviation -> the mean share held by the top 0, 1, ..., N tokens of each row."""
    d = dev.sort(1, descending=True).values
    return (torch.cat([torch.zeros(d.shape[0], 1), d.cumsum(1)], 1) / d.sum(1, keepdim=True).clamp_min(1e-30)).mean(0)
