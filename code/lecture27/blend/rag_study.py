"""04's Part 5: CacheBlend on a real LLaMA (SmolLM2-135M-Instruct, or another GGUF file), handout §5.1-5.4,
as results with named fields. The measuring is rag.py's and prefix_caching.measured's; this module
loads the model and the inputs, runs them, and keeps what 04 shows:

    load            the model, its tokenizer and the key its cached results are filed under
    inputs          the built-in RAG items, or the student's own passages (one chunk per passage)
    experiment      KL to full prefill of every rule measured (blend_rules.ALL_RULES with --curve), random and
                    the two oracles; live TTFT per rule; greedy answers; the query rules over j and the
                    chunks prefilled with no shared prefix (--curve): rag.real_experiment's Experiment
    deviation       the two insights on the real model's KV deviation
    toy_insights    the record world's, beside them
    curve_studies   --curve: the built-in items with shorter chunks, a rule whose count adapts beside flat

A new selection rule added to blend_rules.RULES is measured by every one of them: nothing here names a rule.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

from lecture27 import blend_rules
from lecture27 import kvstore as ks
from lecture27.blend import rag as blend_rag
from lecture27.blend import prefix_caching as pc
from lecture27.blend_world import heldout, spearman, top_share
from lecture27.blend.record_blend import insights
from lecture27.record_trainer import record_model
from common.checkpoints import TrainingFailed


@dataclass
class LM:
    """A loaded LLaMA: the model, its tokenizer, its name and the key its cached results are filed under."""
    model: object
    tok: object
    name: str
    model_id: str


@dataclass
class Deviation:
    """The two insights on the real model: the top tokens' share of the KV deviation, per layer 1.. and
    their mean, and the rank correlation of adjacent layers (means over the inputs)."""
    top_per_layer: list[float]
    top_share: float
    rank_corr: list[float]


@dataclass
class ToyInsights:
    top_share: float
    rank_corr: list[float]


@dataclass(kw_only=True)
class Real:
    """Part 5 as 04 shows it: the experiment and the studies beside it."""
    run: blend_rag.Experiment
    source: str                     # where the inputs came from
    model_name: str
    n_layers: int
    default_rule: str               # 04's default --rule
    insights: Deviation
    toy: ToyInsights | None         # the record world's, beside it
    prefix: pc.Measured | None      # §5.1 on the built-in items (None with --passages)
    split: blend_rag.Decomposition         # the run's rule, its ranking oracle and the patch oracle at each ratio
    splits: dict                    # every rule measured: its Decomposition (--curve: every rule)
    chunks: blend_rag.ChunkLengths | None  # --curve on the built-in items: the same items with shorter chunks
    adaptive: blend_rag.RuleComparison | None  # --curve: a rule whose count adapts, beside flat


def load(gguf: str | None) -> LM:
    from common.gguf_llama import load_gguf_llama

    model, tok, info = load_gguf_llama(gguf, progress=True)
    path = Path(info["path"])
    return LM(model, tok, path.stem, ks.model_id(path))


BUILT_IN = "built-in RAG items (common/english.py)"   # the inputs' source when no --passages


def inputs(lm: LM, passages: str | None, items: int, chunk_tokens: int) -> tuple[list, str]:
    """(RAG inputs, where they came from): the student's passages file, else the built-in items."""
    if passages:
        return [blend_rag.passage_input(it, lm.tok) for it in blend_rag.load_passages(passages)], passages
    return blend_rag.built_in_inputs(lm.tok, items, chunk_tokens), BUILT_IN


def experiment(lm: LM, rags: list, ratio: float, rule: str, curve: bool, curve_ratios, ttft_items: int,
               recompute: bool, tier: str, depths=(), remeasure: bool = False) -> blend_rag.Experiment:
    """rag.real_experiment on the loaded model; with curve, also the query rules over `depths` and the inputs
    with no shared prefix."""
    return blend_rag.real_experiment(lm.model, lm.tok, rags, ratio, lm.model_id, rule, curve, curve_ratios,
                                     ttft_items=min(ttft_items, len(rags)), tier=tier, depths=depths, alone=curve,
                                     recompute=recompute, remeasure=remeasure)


def deviation(run: blend_rag.Experiment, top: float) -> Deviation:
    dev, L = run.deviation, run.deviation[0].shape[0]
    per_layer = [statistics.fmean(top_share(d[i][None], top) for d in dev) for i in range(1, L)]
    corr = [statistics.fmean(spearman(d[i][None], d[i + 1][None]) for d in dev) for i in range(1, L - 1)]
    return Deviation(per_layer, statistics.fmean(per_layer), corr)


def toy_insights(seed: int, locality: float, chunk_len: int, ratio: float, top: float) -> ToyInsights | None:
    """The record world's insights (the cached record model, 200 documents); None when it cannot be had."""
    try:
        toy, _ = record_model(False, seed, locality=locality)
    except TrainingFailed:
        return None
    found = insights(toy, heldout(200), chunk_len, ratio, top)
    return ToyInsights(found.top_share, found.rank_corr)


def curve_studies(lm: LM, rags: list, run: blend_rag.Experiment, source: str, *, built_in: bool, items: int,
                  short_chunks, chunk_tokens: int, top: float, targets, layer: int, floor: float, recompute: bool):
    """--curve: the built-in items with shorter chunks (not for --passages) and the adaptive rule beside flat
    at the same mean recomputed share (both cached): (ChunkLengths or None, RuleComparison)."""
    chunks = blend_rag.chunk_length_study(
        lm.model, lm.tok, n_items=items, lengths=short_chunks, reference=chunk_tokens, ratios=run.ratios,
        ratio=run.ratio, rule=blend_rules.blend_rule_of(run.rule), model_id=lm.model_id, top=top,
        recompute=recompute) if built_in else None
    adaptive = blend_rag.compare_rules(lm.model, lm.tok, rags, targets=targets, layer=layer, floor=floor,
                                       model_id=lm.model_id, source=source, recompute=recompute)
    return chunks, adaptive
