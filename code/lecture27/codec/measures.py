"""What 02_cachegen_codec.py measures of CacheGen's codec (handout §3) around the codec study: the three
observations of §3.2 on a model's KV (token locality, layer sensitivity, entropy by how the tables are
grouped), the baseline codecs of §3.4's table, the arithmetic coder on whole contexts (§3.3), exercises 3
and 4, and the same measurements on a real LLaMA. Every function returns a dataclass; a cached study,
which loads as a dict, becomes one here, where it is loaded.

The record-world study is codec/study.py's, the real model's codec/smollm2.py's, the codec kvcache.py's.
"""
from __future__ import annotations

import dataclasses
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lecture27 import blend_world as bw
from lecture27.codec import smollm2
from lecture27.codec import study as cs
from lecture27 import coder
from lecture27.codec import coder_bench
from lecture27 import kvcache as kv
from common.checkpoints import cached
from common.llama import idle_threads

FP16_BYTES = 2
KV_NAMES = ("K", "V")


# ------------------------------------------------------------------------------------- results
@dataclass
class LayerLocality:
    """Part 1a, one layer: var(raw) / var(delta) for K and V, deltas to the group's anchor or to the
    previous token (>1: deltas are smaller)."""
    K_anchor: float
    K_previous: float
    V_anchor: float
    V_previous: float

    def ratio(self, kind: str, ref: str) -> float:
        return getattr(self, f"{kind}_{ref}")


@dataclass
class LayerSensitivity:
    """Part 1b, one layer rounded coarsely, the others exact: answer accuracy."""
    layer: int
    kv: dict          # step (x RMS) -> accuracy with the layer's K and V rounded to it
    k: float          # K alone at the single step
    v: float          # V alone at the single step


@dataclass
class Sensitivity:
    steps: list               # the K+V steps (x RMS), the single step among them
    step: float               # the single step for K alone and V alone
    layers: list              # LayerSensitivity per layer
    fp16_accuracy: float
    measured_steps: list      # per layer [K, V]: the coarsest steps (x RMS) the search kept


@dataclass(kw_only=True)
class Observations:
    """Part 1 on the record-world model, and the documents it is measured on."""
    n_calib: int
    n_eval: int
    tokens: int               # context tokens of a document
    values_per_token: int
    locality: list            # Part 1a: LayerLocality per layer
    sensitivity: Sensitivity  # Part 1b
    entropy: dict             # Part 1c: grouping -> bits per value


@dataclass
class Quality:
    """A real model's continuation attending to decoded KV: NLL (nats/token), KL from FP16's, top-1 = FP16's."""
    nll: float
    kl: float
    agree: float


@dataclass
class Codec:
    """A row of the codec table: its name as printed, its --json name, bytes per token and its quality:
    the share of answers right (record world) or a Quality (a real model's continuation)."""
    name: str
    key: str | None
    bytes_per_token: float
    quality: Any


@dataclass
class Level:
    """A quality level of the measured codec (level 0 finest); accuracy on the record world, kl and agree
    (top-1 = FP16's) on a real model."""
    level: int
    bytes_per_token: float
    bits_per_value: float
    accuracy: float | None = None
    kl: float | None = None
    agree: float | None = None


@dataclass(kw_only=True)
class Codecs:
    """Part 2 and the levels: every codec, the levels, the mode the measured codec chose (and on the
    record world: the sizes it chose between, the recipe's steps, the answers behind an accuracy)."""
    codecs: list              # Codec rows, in the table's order
    levels: list              # Level 0..3
    uses_deltas: bool
    calib_delta_bytes_per_token: float | None = None   # the measured steps' size on calibration contexts,
    calib_raw_bytes_per_token: float | None = None     # with deltas and without
    recipe_steps: list | None = None            # the recipe's steps / RMS, per layer (K and V alike)
    n_answers: int | None = None                # answers behind each level's accuracy

    def row(self, key: str) -> Codec:
        return next(c for c in self.codecs if c.key == key)

    @property
    def fp16(self) -> Codec:
        return self.row("fp16")

    @property
    def measured(self) -> Codec:
        return self.row("measured")


@dataclass
class OneStream:
    symbols: int
    ideal_bytes: float
    actual_bytes: int
    roundtrip_exact: bool


@dataclass(kw_only=True)
class Bitstreams:
    contexts: int
    symbols: int
    encode_sym_per_s: float
    decode_sym_per_s: float
    bytes: int
    ideal_bytes: float
    roundtrip_exact: bool


@dataclass
class Layout:
    """The streams the codec cuts a context's groups into (kvcache.stream_plan), among every layout."""
    tokens: int               # of a context
    plan: kv.StreamPlan       # the layout the codec uses ...
    streams: int              # ... its streams in one context
    coder: str                # ... and the coder that codes them ("serial" or "parallel")
    plans: list               # kv.StreamPlan of every layout


@dataclass
class CoderCheck:
    """Part 3: one context as one stream, the codec's bitstreams of many, their layout, the levels."""
    one: OneStream
    many: Bitstreams
    layout: Layout
    codecs: Codecs


@dataclass
class PositionError:
    position: int             # in the group; 0 is the anchor
    anchor: float             # mean |error| / step, deltas to the group's anchor (the codec)
    chain: float              # the same, deltas to the previous token


@dataclass
class Independence:
    """Exercise 3: groups that decode alone, a damaged group, the error by position in a group."""
    groups: int
    alone_equal: bool         # every group decoded alone equals the full decode
    damaged_group: int
    spoiled_groups: list      # groups whose values changed after one byte of damaged_group was flipped
    rejected: bool            # the decoder refused the damaged stream instead
    by_position: list         # PositionError per position in a group


@dataclass
class Throughput:
    """Exercise 3 measured: the coders on the same level-0 symbols (coder_bench.coder_throughput), and the
    streams the codec's own bitstreams use."""
    contexts: int             # whose symbols: this many evaluation contexts ...
    unit: str                 # ... "context" or "paragraph"
    tokens: int               # symbols a row: one row per (context, layer, K/V, channel)
    rows: int
    coder: coder_bench.CoderThroughput
    layout: Layout            # the one the codec uses for a context of `tokens` tokens


@dataclass
class Exercise3:
    independence: Independence
    throughput: Throughput


@dataclass
class Exercise4:
    entropy_bits: float
    coded_bits_per_symbol: float
    ideal_bits_per_symbol: float
    fixed_bits: int
    roundtrip_exact: bool


# ------------------------------------------------------------------------------------- the record world
@dataclass(kw_only=True)
class RecordStudy:
    """The record-world codec study (codec/study.py's record_codec_study) as loaded."""
    n_calib: int
    n_eval: int
    tokens_per_context: int
    acc_fp16: float
    steps_over_rms: list      # the measured steps / RMS, per layer [K, V]
    uses_deltas: bool
    calib_bits: tuple         # the measured steps' bits on the calibration contexts, with deltas and without
    levels: list              # Level per quality level
    specs: list               # kv.CodecSpec per quality level
    recipe: Codec
    recipe_steps: list        # the recipe's steps / RMS, per layer (K and V alike)
    variants: tuple           # the measured steps' Codec with deltas and without


@dataclass
class RecordRun:
    """What every Part on the record world reads: the model, its study, the KV of the calibration and
    evaluation documents and the evaluation questions."""
    model: Any
    study: RecordStudy
    Xc: np.ndarray
    Xe: np.ndarray
    ev: tuple                 # evaluation (questions, answers, slots)
    rms: np.ndarray           # of the calibration KV, per (layer, K/V)


def record_study(refit: bool) -> RecordStudy:
    """The cached record-world study (fitted again with refit)."""
    d = cs.record_codec_study(refit=refit)
    chosen = "delta" if d["delta"] else "raw"
    variants = tuple(Codec(f"{'measured' if v == chosen else '  same steps'} "
                           f"({'anchor+delta' if v == 'delta' else 'no deltas'})",
                           "measured" if v == chosen else None, d["variants"][v]["bytes_per_token"],
                           d["variants"][v]["accuracy"]) for v in ("delta", "raw"))
    return RecordStudy(
        n_calib=d["n_calib"], n_eval=d["n_eval"], tokens_per_context=d["tokens_per_context"], acc_fp16=d["acc_fp16"],
        steps_over_rms=d["steps_over_rms"], uses_deltas=bool(d["delta"]),
        calib_bits=(d["calib_bits"]["delta"], d["calib_bits"]["raw"]),
        levels=[Level(lv["level"], lv["bytes_per_token"], lv["bits_per_value"], lv["accuracy"]) for lv in d["levels"]],
        specs=[kv.spec_from_dict(x) for x in d["specs"]],
        recipe=Codec("recipe (anchor+delta, finer shallow)", "recipe", d["recipe"]["bytes_per_token"],
                     d["recipe"]["accuracy"]),
        recipe_steps=[x[0] for x in d["recipe"]["steps_over_rms"]], variants=variants)


def record_run(refit: bool) -> RecordRun:
    """The record-world model and its study, with the exact KV of the study's documents."""
    world = cs.record_world()
    model = world["model"]
    study = record_study(refit)
    calib = world["docs"](cs.CODEC_N_CALIB, cs.CODEC_CALIB_SEED)
    ev = world["docs"](cs.CODEC_N_EVAL, cs.CODEC_EVAL_SEED)
    Xc, Xe = cs.context_kv(model, calib[0]), cs.context_kv(model, ev[0])
    return RecordRun(model, study, Xc, Xe, ev[1:], kv.kv_rms(Xc))


def record_quality(run: RecordRun):
    """quality(decoded evaluation KV) -> the share of the evaluation answers right."""
    return lambda X: cs.answer_accuracy(run.model, X, *run.ev)["acc"]


def record_codecs(run: RecordRun, baselines: list) -> Codecs:
    """Part 2's rows from the baselines and the study: the recipe, the measured codec and the same steps in
    the other mode; and the quality levels."""
    study = run.study
    per_token = [bits / 8 / study.n_calib / study.tokens_per_context for bits in study.calib_bits]
    return Codecs(codecs=baselines + [study.recipe, *study.variants], levels=study.levels,
                  uses_deltas=study.uses_deltas,
                  calib_delta_bytes_per_token=per_token[0], calib_raw_bytes_per_token=per_token[1],
                  recipe_steps=study.recipe_steps, n_answers=study.n_eval * bw.N_RECORDS)


# ------------------------------------------------------------------------------------- calculators
def delta_variance_ratios(X, group) -> list[LayerLocality]:
    """Part 1a. X (N, T, L, 2, C). Per (layer, K/V): sum of per-channel variances of the raw values over
    that of the deltas to the group's anchor (non-anchor tokens) and to the previous token."""
    T = X.shape[1]
    anchors = np.arange(T) % group == 0
    owner = np.arange(T) // group * group
    raw = X.var(axis=(0, 1)).sum(-1)
    to_anchor = raw / (X - X[:, owner])[:, ~anchors].var(axis=(0, 1)).sum(-1)
    to_prev = raw / (X[:, 1:] - X[:, :-1]).var(axis=(0, 1)).sum(-1)
    return [LayerLocality(float(a[0]), float(p[0]), float(a[1]), float(p[1])) for a, p in zip(to_anchor, to_prev)]


def layer_sensitivity(model, X, ev, rms, kv_steps, one_step) -> list[LayerSensitivity]:
    """Part 1b: one layer's K and V rounded to steps of s x RMS for each s in kv_steps, and its K alone
    or V alone at one_step x RMS; all other layers exact."""
    def accuracy(layer, kinds, s):
        Xq = X.copy()
        for k in kinds:
            step = np.float32(s * rms[layer, k])
            Xq[:, :, layer, k] = np.rint(X[:, :, layer, k] / step) * step
        return cs.answer_accuracy(model, Xq, *ev)["acc"]

    return [LayerSensitivity(layer, {s: accuracy(layer, [0, 1], s) for s in kv_steps},
                             accuracy(layer, [0], one_step), accuracy(layer, [1], one_step))
            for layer in range(X.shape[2])]


def cached_sensitivity(model, X, ev, rms, kv_steps, one_step) -> list[LayerSensitivity]:
    """layer_sensitivity, computed once for these steps and this model (then loaded: 12 s of 02's run)."""
    ident = {"model": getattr(model, "cache_key", None), "kv_steps": list(kv_steps), "one_step": one_step,
             "eval": [cs.CODEC_N_EVAL, cs.CODEC_EVAL_SEED],
             "calib": [cs.CODEC_N_CALIB, cs.CODEC_CALIB_SEED]}
    layers = cached("sensitivity-record", ident, lambda: [dataclasses.asdict(x) for x in layer_sensitivity(
        model, X, ev, rms, kv_steps, one_step)])
    return [LayerSensitivity(**x) for x in layers]


GLOBAL = "one global table"
GROUPINGS = {  # table id of each value (t, l, k, c) of a (T, L, 2, C) context
    GLOBAL: lambda t, l, k, c, C, T: 0 * t,
    "by token position": lambda t, l, k, c, C, T: t,
    "by layer (and K/V)": lambda t, l, k, c, C, T: l * 2 + k,
    "by channel (and K/V)": lambda t, l, k, c, C, T: k * C + c,
    "by channel x layer": lambda t, l, k, c, C, T: (l * 2 + k) * C + c,
}


def grouping_entropy(Qc, Qe):
    """Part 1c: bits per value of integers Qe (N, T, L, 2, C) coded with tables fitted on Qc (the
    calibration contexts), one table per group of each grouping (ideal length under the coder's tables)."""
    lo = min(Qc.min(), Qe.min())
    K = int(max(Qc.max(), Qe.max()) - lo + 1)
    T, L, _, C = Qc.shape[1:]
    t, l, k, c = np.meshgrid(np.arange(T), np.arange(L), np.arange(2), np.arange(C), indexing="ij")
    out = {}
    for name, fn in GROUPINGS.items():
        gid = fn(t, l, k, c, C, T)
        n = int(gid.max()) + 1
        ids_c = np.broadcast_to(gid, Qc.shape).ravel()
        counts = np.bincount(ids_c * K + (Qc.ravel() - lo), minlength=n * K).reshape(n, K)
        tables = coder.make_tables(coder.unseen_uniform(counts), [K] * n)
        bits = coder.ideal_bits((Qe - lo).ravel(), tables, np.broadcast_to(gid, Qe.shape).ravel())
        out[name] = bits / Qe.size
    return out


def entropy_at(Xc, Xe, steps) -> dict:
    """Part 1c: grouping_entropy of the calibration and evaluation KV quantized at `steps`, no deltas."""
    raw_spec = kv.fit_codec(Xc, steps, False)
    return grouping_entropy(kv.quantize(Xc, raw_spec), kv.quantize(Xe, raw_spec))


def baseline_rows(Xc, Xe, quality, bits, zlib_level) -> list[Codec]:
    """Part 2's baselines: FP16, zlib on FP16, and n-bit fixed-length codes (one step per channel from the
    calibration contexts' absmax). quality(decoded KV) -> the codec's quality on the evaluation contexts."""
    T, L, C = Xe.shape[1], Xe.shape[2], Xe.shape[4]
    fp16 = Xe.astype(np.float16)
    q16 = quality(fp16.astype(np.float32))
    # zlib on each context's FP16 bytes in the cache's own order (layer, K/V, head, token, dim)
    per_ctx = [np.ascontiguousarray(x.transpose(1, 2, 0, 3)).tobytes() for x in fp16]
    zbytes = sum(len(zlib.compress(b, zlib_level)) for b in per_ctx) / (len(per_ctx) * T)
    rows = [Codec("FP16", "fp16", L * 2 * C * FP16_BYTES, q16), Codec("zlib on FP16", "zlib", zbytes, q16)]
    absmax = np.abs(Xc).max(axis=(0, 1))
    for b in bits:
        q = quality(kv.uniform_quantize(Xe, b, absmax / ((1 << (b - 1)) - 1)))
        rows.append(Codec(f"{b}-bit", f"{b}bit", L * 2 * C * b / 8, q))
    return rows


def coder_check(spec, Xe, n_contexts) -> tuple[OneStream, Bitstreams]:
    """Part 3: one whole context's symbols as one arithmetic-coded stream: actual vs ideal bytes and a
    bit-exact round trip; then the codec's bitstreams of n_contexts contexts, timed."""
    syms, ids = kv.symbols(kv.quantize(Xe[0], spec), spec)
    syms, ids = syms.ravel(), ids.ravel()
    data = coder.encode(syms, list(spec.tables), ids)
    back = coder.decode(data, list(spec.tables), syms.size, ids)
    one = OneStream(syms.size, coder.ideal_bits(syms, list(spec.tables), ids) / 8, len(data),
                    bool(np.array_equal(back, syms)))
    t0 = time.perf_counter()
    streams = kv.codec_encode_many(Xe[:n_contexts], spec)
    t1 = time.perf_counter()
    decoded = kv.codec_decode_many(streams, spec)
    t2 = time.perf_counter()
    n_sym = n_contexts * Xe[0].size
    exact = all(np.array_equal(q, kv.quantize(x, spec)) for q, x in zip(decoded, Xe))
    ideal = sum(kv.codec_bits(spec, x[None]) for x in Xe[:n_contexts]) / 8
    return one, Bitstreams(contexts=n_contexts, symbols=n_sym, encode_sym_per_s=n_sym / (t1 - t0),
                           decode_sym_per_s=n_sym / (t2 - t1), bytes=sum(map(len, streams)), ideal_bytes=ideal,
                           roundtrip_exact=exact)


def stream_layout(spec, tokens: int) -> Layout:
    """The codec's streams for a context of `tokens` tokens, and every layout it chose among."""
    plan = kv.stream_plan(spec, tokens)
    streams = plan.streams * -(-tokens // spec.group)
    return Layout(tokens, plan, streams, kv.coder_for(streams), kv.stream_plans(spec))


def independence(spec_delta, Xe, n) -> Independence:
    """Exercise 3. (a) every group decodes alone from its own bytes, in any order; a damaged group
    spoils only itself. (b) error by position in the group: deltas to the (decoded) anchor vs a chain of
    deltas to the previous token, each quantized with the same steps (decoded by summing the chain)."""
    x = Xe[0]
    data = kv.codec_encode(x, spec_delta)
    full = kv.codec_decode(data, spec_delta)
    G, T = spec_delta.group, x.shape[0]
    n_groups = -(-T // G)
    rows = [slice(g * G, (g + 1) * G) for g in range(n_groups)]
    alone = all(np.array_equal(kv.codec_decode(data, spec_delta, groups=[g])[rows[g]], full[rows[g]])
                for g in reversed(range(n_groups)))
    h = kv.codec_header(data)
    bad = bytearray(data)
    start = h["payload_start"] + h["group_bytes"][0]
    bad[start + h["group_bytes"][1] // 2] ^= 0xFF         # one byte in the middle of group 1
    try:
        damaged = kv.codec_decode(bytes(bad), spec_delta)
        spoiled, rejected = [g for g in range(n_groups) if not np.array_equal(damaged[rows[g]], full[rows[g]])], False
    except coder.CorruptStream:
        spoiled, rejected = [], True
    return Independence(n_groups, alone, 1, spoiled, rejected, position_errors(spec_delta, Xe[:n]))


def position_errors(spec_delta, X) -> list[PositionError]:
    """Exercise 3 (b): mean |error| / step by position in a group, the anchor-relative deltas of the codec
    against a chain of deltas to the previous token (the same 8-bit anchor, the same steps)."""
    G, T = spec_delta.group, X.shape[1]
    step = spec_delta.steps[:, :, None]
    decoded = kv.dequantize(kv.quantize(X, spec_delta), spec_delta)
    chain = np.empty_like(X)
    for t in range(T):
        if t % G == 0:
            chain[:, t] = decoded[:, t]   # the same 8-bit anchor
        else:
            chain[:, t] = chain[:, t - 1] + np.rint((X[:, t] - X[:, t - 1]) / step) * step
    anchor_err, chain_err = np.abs(decoded - X), np.abs(chain - X)
    pos = np.arange(T) % G
    return [PositionError(p, float((anchor_err[:, pos == p] / step).mean()),
                          float((chain_err[:, pos == p] / step).mean())) for p in range(G)]


def coder_throughput(spec, q, counts, unit: str) -> Throughput:
    """Exercise 3 measured on contexts q (N, T, L, 2, C) quantized at `spec`: their symbols as rows, one
    per (context, layer, K/V, channel) over the T tokens, through the serial coder, the parallel coder at
    each of `counts` streams and at all the rows, and constriction's range coder."""
    syms, ids = kv.symbols(q, spec)
    T = q.shape[1]
    rows, row_ids = (a.transpose(0, 2, 3, 4, 1).reshape(-1, T) for a in (syms, ids))
    coders = coder_bench.coder_throughput(rows, row_ids, spec.tables, (*counts, len(rows)))
    return Throughput(len(q), unit, T, len(rows), coders, stream_layout(spec, T))


def exercise4(probs: dict, samples: int) -> Exercise4:
    """Exercise 4 on a distribution: entropy, the coder's bits per value on its samples, the fixed-length code."""
    return Exercise4(**coder.exercise4(probs, samples))


def level_noise(levels, n_answers: int) -> list[float]:
    """Binomial standard error of each level's accuracy over n_answers answers (answers of one document
    share its context, so this is a lower bound on the noise)."""
    return [(lv.accuracy * (1 - lv.accuracy) / n_answers) ** 0.5 for lv in levels]


def pareto_front(points: list) -> list:
    """points: (name, bytes/token, accuracy %); the (bytes, accuracy) of those no smaller codec beats."""
    front = sorted(points, key=lambda p: (p[1], -p[2]))
    best = np.maximum.accumulate([a for *_, a in front])
    return [(b, a) for i, (_, b, a) in enumerate(front) if i == 0 or a > best[i - 1]]


# ------------------------------------------------------------------------------------- a real model
@dataclass
class LocalitySpan:
    """Part 1a over a span of layers, for K or V: (mean, min, max) of var(raw) / var(delta), deltas to the
    group's anchor and to the previous token."""
    first: int
    last: int
    kind: str
    anchor: tuple
    previous: tuple


def locality_by_thirds(locality: list, layers: int) -> list[LocalitySpan]:
    """Part 1a by the shallow, middle and deep thirds of the layers (kvcache.layer_groups), K then V."""
    third = kv.layer_groups(layers)
    out = []
    for g in (np.flatnonzero(third == i) for i in range(3)):
        for kind in KV_NAMES:
            ratios = [np.array([locality[i].ratio(kind, to) for i in g]) for to in ("anchor", "previous")]
            out.append(LocalitySpan(int(g[0]), int(g[-1]), kind, *((x.mean(), x.min(), x.max()) for x in ratios)))
    return out


@dataclass(kw_only=True)
class Real:
    """02's measurements on a real LLaMA (smollm2.py's prose): Parts 1a, 1c and 2, and the levels."""
    name: str
    layers: int
    channels: int
    tokens: int
    n_calib: int
    n_eval: int
    locality: list            # LayerLocality per layer
    thirds: list              # LocalitySpan per third of the layers and K/V
    entropy: dict             # grouping -> bits per value
    codecs: Codecs            # rows' quality: a Quality
    rel_steps: list           # the measured steps / RMS, per third of the layers: [K, V]
    coded_spec: Any           # level 0's kv.CodecSpec ...
    coded_q: np.ndarray       # ... and the evaluation contexts it codes, quantized (exercise 3 measured)


@dataclass
class RealCoders:
    """Exercise 3 measured on a real model's KV."""
    model: str
    throughput: Throughput


def real_measures(gguf, refit: bool, entropy_step: float, baseline_bits, zlib_level: int) -> Real:
    """SmolLM2: the measured codec (smollm2.py: step search under a KL budget), the baselines and the
    recipe at the same size, all on the evaluation prose. Cached in code/checkpoints/ like the study it
    builds on (several minutes of forwards and codec fits); refit measures again."""
    from common.gguf_llama import gguf_file
    path = gguf_file(gguf)
    ident = {**smollm2.study_ident(path), "measure": [entropy_step, baseline_bits, zlib_level,
                                                kv.RECIPE_GROUP_FACTOR, kv.MATCH_HALVINGS]}
    r = cs.cached_study("codec-smollm2-02", ident, lambda: measure_real(
        path, refit, entropy_step, baseline_bits, zlib_level), refit, idle_threads)
    quality = lambda q: Quality(q["nll"], q["kl"], q["agree"])  # noqa: E731
    rows = [Codec(name, name.split(" ")[0].replace("-", "").lower(), b, quality(q))
            for name, (b, q) in r["rows"].items()]
    levels = [Level(i, lv["bytes_per_token"], lv["bits_per_value"], kl=lv["kl"], agree=lv["agree"])
              for i, lv in enumerate(r["levels"])]
    d = r["delta_ratio"]
    locality = [LayerLocality(a[0], p[0], a[1], p[1]) for a, p in zip(d["anchor"], d["previous"])]
    name = Path(r["info"]["path"]).stem     # the file's name, as 04 names it (its metadata's name is a run's)
    return Real(name=name, layers=r["L"], channels=r["C"], tokens=r["tokens"], n_calib=r["n_calib"],
                n_eval=r["n_eval"], locality=locality, thirds=locality_by_thirds(locality, r["L"]),
                entropy=r["entropy"], codecs=Codecs(codecs=rows, levels=levels, uses_deltas=r["delta"]),
                rel_steps=r["rel_steps"], coded_spec=kv.spec_from_dict(r["coded"]["spec"]),
                coded_q=np.array(r["coded"]["q"]))


def measure_real(path, refit: bool, entropy_step: float, baseline_bits, zlib_level: int) -> dict:
    """The real model's measurements as cached: {"rows": {codec name: (bytes/token, quality)}, "levels", ...}."""
    prose = smollm2.Prose(path)
    study = smollm2.real_codec_study(path, refit=refit, prose=prose)
    Xc, Xe = prose.Xc, prose.Xe
    L, C, T = Xe.shape[2], Xe.shape[4], Xe.shape[1]
    rms = kv.kv_rms(Xc)
    delta = study["delta"]
    target = study["calib_bits"]["delta" if delta else "raw"]   # the measured codec's bits on calibration KV
    base = kv.match_bytes(lambda b: kv.fitted_bits(Xc, kv.recipe_steps(rms, b), True), target)
    rows = {c.name: (c.bytes_per_token, c.quality)
            for c in baseline_rows(Xc, Xe, prose.quality, baseline_bits, zlib_level)}
    recipe = smollm2.measure(prose, kv.fit_codec(Xc, kv.recipe_steps(rms, base), True))
    rows["recipe (anchor+delta, finer shallow)"] = (recipe["bytes_per_token"], recipe)
    level0 = study["levels"][0]
    rows[f"measured ({'anchor+delta' if delta else 'no deltas'})"] = (level0["bytes_per_token"], level0)
    ratios = delta_variance_ratios(Xe, kv.CODEC_GROUP)
    spec0 = kv.fit_codec(Xc, np.asarray(study["steps"]), delta)   # level 0's spec, as smollm2.fit made it
    return {"info": prose.info, "tokens": T, "n_eval": len(Xe), "n_calib": len(Xc), "L": L, "C": C,
            "delta_ratio": {ref: [[lv.ratio(k, ref) for k in KV_NAMES] for lv in ratios]
                            for ref in ("anchor", "previous")},
            "rows": rows, "rel_steps": study["rel_steps"], "delta": bool(delta), "calib_bits": study["calib_bits"],
            "levels": study["levels"], "entropy": entropy_at(Xc, Xe, rms * entropy_step),
            "coded": {"spec": kv.spec_to_dict(spec0), "q": kv.quantize(Xe[:smollm2.REAL_CODED], spec0)}}
