"""02 -- CacheGen part one (handout §3): compress KV like video, measured on the record-world model.

    python code/lecture27/02_cachegen_codec.py                  # Parts 1-3, the levels, exercises 3-4, two figures
    python code/lecture27/02_cachegen_codec.py --json out.json  # + headline figures as JSON (--no-plot: no figures)
    python code/lecture27/02_cachegen_codec.py --sensitivity-step 0.5   # Part 1b with finer coarse steps
    python code/lecture27/02_cachegen_codec.py --refit          # redo the codec's step search and tables
    python code/lecture27/02_cachegen_codec.py --model smollm2  # Parts 1a, 1c, 2, exercise 3's coders on SmolLM2-135M

Part 1: CacheGen's three observations (§3.2) measured on the record-world model (blend_world.py):
        (a) token locality: variance of raw K/V over variance of deltas (to the group's anchor, to the
        previous token), per layer; (b) layer sensitivity: one layer quantized coarsely, the others
        exact -> answer accuracy; (c) entropy of the quantized values with tables grouped by channel,
        layer, channel x layer, token position, or one global table.
Part 2: the codec table: FP16, zlib on FP16, 8-bit, 6-bit, CacheGen's recipe as published (anchor +
        delta, finer steps in shallow layers, arithmetic coding), and the "measured" codec (steps from a
        greedy search for the coarsest steps that keep the answers, per-(channel, layer) arithmetic
        coding); bytes/token, ratio to FP16, accuracy on documents never seen in training.
Part 3: the arithmetic coder on a whole context: actual length vs the ideal -sum log2 p, bit-exact
        round trip, throughput. Then the four quality levels 03_streaming.py reads, exercises 3 and 4
        (exercise 3 measured: the serial coder, the parallel coder at CODER_STREAMS streams and at one
        stream per (layer, K/V, channel), and constriction's range coder, on the same symbols).

Accuracy of a codec: the question's tokens attend to the decoded context KV instead of the exact one.
The codec is fitted once per model on calibration documents (one seed) and evaluated on other
documents (another seed); its step search and tables are cached in code/checkpoints/ (computed again
when a setting below changes, or with --refit).
Every figure is computed here; the "handout" column is the reference the handout prints.

Settings of the codec itself live in the library, because 03_streaming.py reads the same codec:
  kvcache.py      CODEC_GROUP (tokens per anchor group), ANCHOR_BITS, LEVEL_FACTOR and N_LEVELS (the
                  quality levels), RECIPE_GROUP_FACTOR (the published recipe's step growth),
                  STREAM_BUDGET and PARALLEL_MIN_STREAMS (how a group is cut into streams)
  codec_study.py  MEASURE_TOL and STEP_* (the step search), CODEC_N_CALIB / CODEC_N_EVAL / CODEC_N_CODED
                  (documents) and their seeds
  codec_real.py   REAL_MAX_KL (the real model's quality budget), REAL_CONTEXT / REAL_CONTINUATION
The settings at the top of this file are the measurements' own.
"""
from __future__ import annotations

import dataclasses
import sys
import time
import zlib
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

import codec_real as cr  # noqa: E402
import codec_study as cs  # noqa: E402
import kvcache as kv  # noqa: E402
import blend_world as bw  # noqa: E402
from common.checkpoints import cached  # noqa: E402
from common.cli import Parser, positive_float, settings_from, shipped_defaults  # noqa: E402
from common.llama import idle_threads, single_thread  # noqa: E402
from common.present import (  # noqa: E402
    Chart, Field, Handout, Page, Ref, Row, Series, Table, Val, chart_figure, cols, plural, table_of)

SENSITIVITY_STEPS = (1, 2, 4, 8)  # Part 1b: coarse steps for one layer's K+V, in units of its RMS
SENSITIVITY_STEP = 4.0      # Part 1b: the coarse step for K alone and V alone
ENTROPY_LEVEL = 0           # Part 1c: the values quantized at this level's steps
ZLIB_LEVEL = 9              # Part 2: zlib's best compression
BASELINE_BITS = (8, 6)      # Part 2: plain n-bit quantization rows (the handout's 8-bit and 6-bit)
EX4_PROBS = {0: 0.70, 1: 0.12, -1: 0.12, 2: 0.03, -2: 0.03}   # exercise 4: a distribution of quantized values
EX4_SAMPLES = 100_000       # exercise 4: symbols drawn from EX4_PROBS
EX3_CONTEXTS = 200          # exercise 3: contexts for the error-by-position comparison
CODER_STREAMS = (1, 16, 256)  # exercise 3: the parallel coder's stream counts (and all: one per (layer, K/V, channel))
REAL_ENTROPY_STEP = 0.25    # Part 1c on the real model: values quantized at this x each layer's RMS
REAL_BASELINE_BITS = (8, 6, 4)   # Part 2 on the real model: plain n-bit quantization rows
FP16_BYTES = 2
KV_NAMES = ("K", "V")
SCRIPT = "02_cachegen_codec"


@dataclass(frozen=True)
class Settings:
    """One run's inputs: the constants above, with the command line's flags over them."""
    model: str = "record"                 # record: the record-world model; smollm2: a real LLaMA
    gguf: str | None = None               # with smollm2: another LLaMA GGUF file
    sensitivity_step: float = SENSITIVITY_STEP
    sensitivity_steps: tuple = SENSITIVITY_STEPS
    entropy_level: int = ENTROPY_LEVEL
    zlib_level: int = ZLIB_LEVEL
    baseline_bits: tuple = BASELINE_BITS
    ex3_contexts: int = EX3_CONTEXTS
    coder_streams: tuple = CODER_STREAMS
    ex4_probs: dict = field(default_factory=partial(dict, EX4_PROBS))
    ex4_samples: int = EX4_SAMPLES
    real_entropy_step: float = REAL_ENTROPY_STEP
    real_baseline_bits: tuple = REAL_BASELINE_BITS


# The handout's figures, printed beside ours (reference only; nothing is computed from them), and the
# inputs each holds for: the record-world model's figures blank on another model, exercise 4's on
# another distribution.
RECORD = {"model": "record"}
EX4_HANDOUT = {"ex4_probs": {0: 0.70, 1: 0.12, -1: 0.12, 2: 0.03, -2: 0.03}}   # the handout's distribution
HANDOUT = Handout({
    "delta_ratio": Ref("2.4-2.9x (LLaMA)"),                       # §3.2: deltas' variance 2.4-2.9x smaller
    "sensitivity": Ref("shallow layers are the most sensitive"),  # §3.2, on LLaMA
    "entropy": Ref("up to 53% below one global table (LLaMA)"),   # §3.3
    "fp16": Ref("512 B", RECORD), "zlib": Ref("1.08x", RECORD), "6bit": Ref("no loss", RECORD),
    "recipe": Ref("worst accuracy", RECORD), "measured": Ref("no loss; 1.66x < 8-bit, 1.28x < 6-bit", RECORD),
    "vs_8bit": Ref("1.66x", RECORD), "vs_6bit": Ref("1.28x", RECORD), "level3": Ref("74%", RECORD),
    "coder": Ref("a fraction of a byte"),
    "ex4_entropy_bits": Ref("1.40", EX4_HANDOUT), "ex4_fixed_bits": Ref("3", EX4_HANDOUT),
    # §3.4: CacheGen on LLaMA, and the slides' ranges
    "cachegen_vs_8bit": Ref("3.5-4.3x (LLaMA)"), "slides_kv": Ref("3-10x smaller KV"),
    "slides_transfer": Ref("2-8x faster transfer"),
})


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


@dataclass
class Codec:
    """A row of the codec table: its name as printed, its --json name, bytes per token and its quality:
    the share of answers right (record world) or {"nll", "kl", "agree"} (a real model's continuation)."""
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


@dataclass
class Codecs:
    """Part 2 and the levels: every codec, the levels, the mode the measured codec chose (and on the
    record world: the sizes it chose between, the recipe's steps, the answers behind an accuracy)."""
    codecs: list              # Codec rows, in the table's order
    levels: list              # Level 0..3
    uses_deltas: bool
    calib_bytes_per_token: dict | None = None   # "delta" / "raw": the measured steps' size on calibration contexts
    recipe_steps: list | None = None            # the recipe's steps / RMS, per layer (K and V alike)
    n_answers: int | None = None                # answers behind each level's accuracy

    def by_key(self) -> dict:
        return {c.key: c for c in self.codecs if c.key}


@dataclass
class OneStream:
    symbols: int
    ideal_bytes: float
    actual_bytes: int
    roundtrip_exact: bool


@dataclass
class Bitstreams:
    contexts: int
    symbols: int
    encode_sym_per_s: float
    decode_sym_per_s: float
    bytes: int
    ideal_bytes: float
    roundtrip_exact: bool


@dataclass
class PositionError:
    position: int             # in the group; 0 is the anchor
    anchor: float             # mean |error| / step, deltas to the group's anchor (the codec)
    chain: float              # the same, deltas to the previous token


@dataclass
class Exercise3:
    groups: int
    alone_equal: bool         # every group decoded alone equals the full decode
    damaged_group: int
    spoiled_groups: list      # groups whose values changed after one byte of damaged_group was flipped
    rejected: bool            # the decoder refused the damaged stream instead
    by_position: list         # PositionError per position in a group


@dataclass
class Throughput:
    """Exercise 3 measured: the coders on the same level-0 symbols (kvcache.coder_throughput), and the
    streams the codec's own bitstreams use."""
    what: str                 # whose symbols: "200 evaluation contexts"
    tokens: int               # symbols a row: one row per (context, layer, K/V, channel)
    rows: int
    coder: kv.CoderThroughput
    plans: list               # kv.StreamPlan of every layout
    plan: kv.StreamPlan       # the one the codec uses for a context of `tokens` tokens ...
    plan_streams: int         # ... its streams in one context
    plan_coder: str           # ... and the coder that codes them ("serial" or "parallel")


@dataclass
class Exercise4:
    entropy_bits: float
    coded_bits_per_symbol: float
    ideal_bits_per_symbol: float
    fixed_bits: int
    roundtrip_exact: bool


@dataclass
class Record:
    """Everything 02 measures on the record-world model."""
    n_calib: int
    n_eval: int
    tokens: int
    values_per_token: int
    locality: list            # Part 1a: LayerLocality per layer
    sensitivity: Sensitivity  # Part 1b
    entropy: dict             # Part 1c: grouping -> bits per value
    codecs: Codecs            # Part 2, the levels
    one: OneStream            # Part 3
    many: Bitstreams
    ex3: Exercise3
    ex4: Exercise4
    throughput: Throughput    # exercise 3 measured


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


GROUPINGS = {  # table id of each value (t, l, k, c) of a (T, L, 2, C) context
    "one global table": lambda t, l, k, c, C, T: 0 * t,
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
        tables = kv.make_tables(kv.unseen_uniform(counts), [K] * n)
        bits = kv.ideal_bits((Qe - lo).ravel(), tables, np.broadcast_to(gid, Qe.shape).ravel())
        out[name] = bits / Qe.size
    return out


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
    syms, ids = kv._symbols(kv.quantize(Xe[0], spec), spec)
    syms, ids = syms.ravel(), ids.ravel()
    data = kv.encode(syms, list(spec.tables), ids)
    back = kv.decode(data, list(spec.tables), syms.size, ids)
    one = OneStream(syms.size, kv.ideal_bits(syms, list(spec.tables), ids) / 8, len(data),
                    bool(np.array_equal(back, syms)))
    t0 = time.perf_counter()
    streams = kv.codec_encode_many(Xe[:n_contexts], spec)
    t1 = time.perf_counter()
    decoded = kv.codec_decode_many(streams, spec)
    t2 = time.perf_counter()
    n_sym = n_contexts * Xe[0].size
    exact = all(np.array_equal(q, kv.quantize(x, spec)) for q, x in zip(decoded, Xe))
    ideal = sum(kv.codec_bits(spec, x[None]) for x in Xe[:n_contexts]) / 8
    return one, Bitstreams(n_contexts, n_sym, n_sym / (t1 - t0), n_sym / (t2 - t1), sum(map(len, streams)), ideal,
                           exact)


def exercise3(spec_delta, Xe, n) -> Exercise3:
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
    except kv.CorruptStream:
        spoiled, rejected = [], True
    # (b) anchor-relative (the codec) vs previous-token chain
    X = Xe[:n]
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
    by_pos = [PositionError(p, float((anchor_err[:, pos == p] / step).mean()),
                            float((chain_err[:, pos == p] / step).mean())) for p in range(G)]
    return Exercise3(n_groups, alone, 1, spoiled, rejected, by_pos)


def coder_throughput(spec, q, counts, what: str) -> Throughput:
    """Exercise 3 measured on contexts q (N, T, L, 2, C) quantized at `spec`: their symbols as rows, one
    per (context, layer, K/V, channel) over the T tokens, through the serial coder, the parallel coder at
    each of `counts` streams and at all the rows, and constriction's range coder."""
    syms, ids = kv._symbols(q, spec)
    T = q.shape[1]
    rows, row_ids = (a.transpose(0, 2, 3, 4, 1).reshape(-1, T) for a in (syms, ids))
    plan = kv.stream_plan(spec, T)
    streams = plan.streams * -(-T // spec.group)
    return Throughput(what, T, len(rows), kv.coder_throughput(rows, row_ids, spec.tables, (*counts, len(rows))),
                      kv.stream_plans(spec), plan, streams, kv.coder_for(streams))


def exercise4(s: Settings) -> Exercise4:
    """Exercise 4 on the run's distribution: entropy, the coder's bits per value on its samples, the
    fixed-length code."""
    return Exercise4(**kv.exercise4(s.ex4_probs, s.ex4_samples))


def level_noise(levels, n_answers: int) -> list[float]:
    """Binomial standard error of each level's accuracy over n_answers answers (answers of one document
    share its context, so this is a lower bound on the noise)."""
    return [(lv.accuracy * (1 - lv.accuracy) / n_answers) ** 0.5 for lv in levels]


def codecs(study: dict, baselines: list[Codec]) -> Codecs:
    """Part 2's rows from the baselines and the cached study: the recipe, the measured codec and the
    same steps in the other mode; and the quality levels."""
    rows = baselines + [Codec("recipe (anchor+delta, finer shallow)", "recipe", study["recipe"]["bytes_per_token"],
                              study["recipe"]["accuracy"])]
    chosen = "delta" if study["delta"] else "raw"
    for v in ("delta", "raw"):
        m = study["variants"][v]
        name = f"{'measured' if v == chosen else '  same steps'} ({'anchor+delta' if v == 'delta' else 'no deltas'})"
        rows.append(Codec(name, "measured" if v == chosen else None, m["bytes_per_token"], m["accuracy"]))
    per_token = {k: study["calib_bits"][k] / 8 / study["n_calib"] / study["tokens_per_context"]
                 for k in ("delta", "raw")}
    levels = [Level(lv["level"], lv["bytes_per_token"], lv["bits_per_value"], lv["accuracy"]) for lv in study["levels"]]
    return Codecs(rows, levels, bool(study["delta"]), per_token, [x[0] for x in study["recipe"]["steps_over_rms"]],
                  study["n_eval"] * bw.N_RECORDS)


def compute(s: Settings, refit: bool) -> Record:
    world = cs.record_world()
    model = world["model"]
    study = cs.record_codec_study(refit=refit)
    calib = world["docs"](cs.CODEC_N_CALIB, cs.CODEC_CALIB_SEED)
    ev = world["docs"](cs.CODEC_N_EVAL, cs.CODEC_EVAL_SEED)
    Xc, Xe = cs.context_kv(model, calib[0]), cs.context_kv(model, ev[0])
    specs = [kv.spec_from_dict(d) for d in study["specs"]]
    rms = kv.kv_rms(Xc)
    steps = sorted({*s.sensitivity_steps, s.sensitivity_step})
    sens = Sensitivity(steps, s.sensitivity_step, cached_sensitivity(model, Xe, ev[1:], rms, steps, s.sensitivity_step),
                       study["acc_fp16"], study["steps_over_rms"])
    raw_spec = kv.fit_codec(Xc, specs[s.entropy_level].steps, False)
    quality = lambda X: cs.answer_accuracy(model, X, *ev[1:])["acc"]  # noqa: E731
    one, many = coder_check(specs[0], Xe, cs.CODEC_N_CODED)
    return Record(study["n_calib"], study["n_eval"], Xe.shape[1], int(np.prod(Xe.shape[2:])),
                  delta_variance_ratios(Xe, kv.CODEC_GROUP), sens,
                  grouping_entropy(kv.quantize(Xc, raw_spec), kv.quantize(Xe, raw_spec)),
                  codecs(study, baseline_rows(Xc, Xe, quality, s.baseline_bits, s.zlib_level)), one, many,
                  exercise3(kv.fit_codec(Xc, specs[0].steps, True), Xe, s.ex3_contexts), exercise4(s),
                  coder_throughput(specs[0], kv.quantize(Xe[:cs.CODEC_N_CODED], specs[0]), s.coder_streams,
                                   f"{cs.CODEC_N_CODED} evaluation contexts"))


# ------------------------------------------------------------------------------------------ output
pct1, pct2, times2 = "{:.1%}".format, "{:.2%}".format, "{:.2f}x".format


def handout_figure(name: str, s: Settings, text: str | None = None):
    """The handout's figure `name` for this run's inputs: its Ref, or `text` holding it; None (or "") for
    other inputs, or where the handout has no such figure."""
    ref = HANDOUT(name, s) if name in HANDOUT.refs else None
    return ref if text is None else text.format(ref.figure) if ref else ""


def codec_cells(c: Codec, fp16: float) -> list:
    """A codec row's name, bytes/token and ratio to FP16 (with the spec's keys for FP16's and zlib's)."""
    return [c.name, Val(c.bytes_per_token, "fp16_bytes_per_token" if c.key == "fp16" else None),
            Val(fp16 / c.bytes_per_token, "zlib_ratio" if c.key == "zlib" else None)]


def entropy_table(entropy: dict, title: str) -> Table:
    """Part 1c: bits per value under each grouping of the tables, against one global table."""
    g0 = entropy["one global table"]
    smaller = {g: None if g == "one global table" else 1 - b / g0 for g, b in entropy.items()}
    return table_of(title, "§3.2", [Field("tables"), Field("bits/value", "{:.3f}", "entropy_bits.{row}", get=entropy),
                                    Field("smaller than global", "{:+.1%}", get=smaller)],
                    entropy, f"{SCRIPT}.grouping_entropy")


def headline_table(codecs: Codecs, model_name: str, source: str, s: Settings) -> Table:
    """§3.4's headline: CacheGen's size against 8-bit quantization and the slides' ranges, ours beside them."""
    c = {k: x.bytes_per_token / codecs.by_key()["measured"].bytes_per_token for k, x in codecs.by_key().items()}
    return Table(f"  {model_name}: the measured codec (level 0) beside CacheGen's figures", "§3.4",
                 cols("§3.4 headline", ("ours", times2)), [
                     Row(["smaller than 8-bit quantization", c.get("8bit")], HANDOUT("cachegen_vs_8bit", s)),
                     Row(["KV smaller than FP16", c["fp16"]], HANDOUT("slides_kv", s)),
                     Row(["transfer faster than FP16 KV, same link", c["fp16"]], HANDOUT("slides_transfer", s))],
                 source, ["At a fixed bandwidth transfer time is bytes / bandwidth, so our transfer speed-up is the "
                          "size ratio; the slides' transfer range is end to end (decoding and network included)."])


def present_part1(page: Page, r: Record, s: Settings) -> None:
    page.say(f"Record-world model: {r.n_calib} calibration documents (seed {cs.CODEC_CALIB_SEED}), {r.n_eval} "
             f"evaluation documents (seed {cs.CODEC_EVAL_SEED}), {r.tokens} context tokens each, "
             f"{r.values_per_token} K/V values per token.")
    page.part("Part 1", "§3.2", "CacheGen's three observations, measured on the record-world model")
    page.table(Table(
        "Part 1a (§3.2). Token locality: variance of raw values over variance of deltas (>1: deltas are smaller)",
        "§3.2", cols("", ("raw/delta var (anchor)", times2), ("raw/delta var (previous)", times2)),
        [Row([f"layer {i} {k}", lv.ratio(k, "anchor"), lv.ratio(k, "previous")], HANDOUT("delta_ratio", s)
             if (i, k) == (0, "K") else None) for i, lv in enumerate(r.locality) for k in KV_NAMES],
        f"{SCRIPT}.delta_variance_ratios", json={"delta_var_ratio": r.locality}))
    sens, a, d = r.sensitivity, r.sensitivity.step, "layer_sensitivity_detail[]."
    acc = [x.kv[a] for x in sens.layers]
    low = int(np.argmin(acc))
    verdict = (f"every layer answers alike ({acc[0]:.1%})." if min(acc) == max(acc) else f"layer {low} loses the "
               f"most ({acc[low]:.1%} answered): "
               + ("the shallowest, as on LLaMA." if low == 0 else "not the shallowest, unlike LLaMA."))
    page.table(Table(
        f"Part 1b (§3.2). Layer sensitivity: one layer rounded to steps of @ x its RMS, the rest exact (FP16: "
        f"{sens.fp16_accuracy:.2%});\nlast column: the coarsest steps (x RMS) the search kept."
        + handout_figure("sensitivity", s, " CacheGen: {}."), "§3.2",
        cols("", *((f"{kind} @{x:g}", pct1, f"{d}{kind}@{x:g}") for kind, steps in (("K+V", sens.steps), ("K", [a]),
                                                                                   ("V", [a])) for x in steps),
             ("measured steps K / V", lambda v: " / ".join(f"{x:.3g}" for x in v), "measured_steps_over_rms")),
        [Row([f"layer {x.layer}", *(x.kv[t] for t in sens.steps), x.k, x.v, m])
         for x, m in zip(sens.layers, sens.measured_steps)], f"{SCRIPT}.layer_sensitivity",
        [f"At steps of {a:g} x RMS {verdict}"], json={"layer_sensitivity_acc": acc,
                                                     "layer_sensitivity_step_over_rms": a}))
    page.table(entropy_table(r.entropy, f"Part 1c (§3.2, §3.3). Entropy of the values quantized at level "
                             f"{s.entropy_level}'s steps, tables fitted on calibration contexts,\nmeasured on "
                             f"evaluation contexts." + handout_figure("entropy", s, " CacheGen: {}; by token position "
                                                                                   "hardly helps.")))
    band, x = handout_figure("delta_ratio", s, "{}").split("x")[0], list(range(len(r.locality)))  # "2.4-2.9x (LLaMA)"
    chart_figure(page, "02_delta_variance.png", [Chart(
        [Series(x, [lv.ratio(k, to) for lv in r.locality], f"{k}, delta to {to}", "bar")
         for to in ("anchor", "previous") for k in KV_NAMES], ylabel="var(raw) / var(delta)",
        band=(*map(float, band.split("-")), f"CacheGen on LLaMA: {band}x") if band else None,
        hlines=[(1, {"color": "k", "lw": 0.8})], legend={"fontsize": 7},
        axes={"xticks": x, "xticklabels": [f"layer {i}" for i in x]})],
                 "Token locality on the record-world model (>1: deltas smaller)", figsize=(7, 3.6))


def present_part2(page: Page, r: Record, s: Settings) -> None:
    page.part("Part 2", "§3.4", "The codec table")
    c, by = r.codecs, r.codecs.by_key()
    fp16, m = by["fp16"], by["measured"]
    vs = [(f"{x:.2f}x smaller" if x >= 1 else f"{1 / x:.2f}x larger") + f" than {by[k].name}"
          + handout_figure(f"vs_{k}", s, " (handout {})")
          for k, x in ((k, by[k].bytes_per_token / m.bytes_per_token) for k in (f"{b}bit" for b in s.baseline_bits))]
    page.table(Table(
        "Part 2 (§3.4). The codec table (accuracy on unseen records; the arithmetic-coded rows count\nevery byte of "
        f"the bitstream, header included, on {cs.CODEC_N_CODED} coded contexts)", "§3.4",
        cols("codec", ("bytes/token", "{:.1f}", "bytes_{row}"), ("ratio to FP16", times2),
             ("accuracy", pct2, "acc_{row}")),
        [Row([*codec_cells(x, fp16.bytes_per_token), Val(x.quality, "acc_fp16" if x is fp16 else None)],
             handout_figure(x.key, s), None if x.key in ("fp16", "zlib") else x.key) for x in c.codecs],
        f"{SCRIPT}.codecs",
        [f"Measured codec: {', '.join(vs)}, accuracy {100 * (m.quality - fp16.quality):+.2f} points vs FP16.",
         f"Mode chosen on calibration bits: {'anchor+delta' if c.uses_deltas else 'no deltas'} (calibration: "
         f"{c.calib_bytes_per_token['delta']:.1f} vs {c.calib_bytes_per_token['raw']:.1f} B/token with / without "
         f"deltas). Recipe: steps / RMS by layer {', '.join(f'{x:.3g}' for x in c.recipe_steps)}, sized to the "
         f"measured codec's bytes."], json={"measured_uses_deltas": c.uses_deltas}))
    page.table(headline_table(c, "record-world model", f"{SCRIPT}.codecs", s))
    points = [(x.name.strip(), x.bytes_per_token, 100 * x.quality) for x in c.codecs] + [
        (f"level {lv.level}", lv.bytes_per_token, 100 * lv.accuracy) for lv in c.levels[1:]]
    ticks = [8, 16, 32, 64, 128, 256, 512]
    chart_figure(page, "02_codec_pareto.png", [Chart(
        [Series(b, a, f"{n}: {b:.0f} B, {a:.1f}%", "scatter", {"s": 30, "marker": mk})
         for (n, b, a), mk in zip(points, "osD^v<>pP*Xh" * 2)] + [Series(*zip(*pareto_front(points)), "Pareto front",
                                                                        style={"color": "k", "ls": "--", "lw": 0.8})],
        "bytes / token (log)", "answer accuracy (%)", xscale="log", minor_ticks=False,
        legend={"fontsize": 7, "loc": "lower right"}, axes={"xticks": ticks, "xticklabels": ticks})],
                 "Every codec on the record-world model", figsize=(8, 5))


def pareto_front(points: list) -> list:
    """points: (name, bytes/token, accuracy %); the (bytes, accuracy) of those no smaller codec beats."""
    front = sorted(points, key=lambda p: (p[1], -p[2]))
    best = np.maximum.accumulate([a for *_, a in front])
    return [(b, a) for i, (_, b, a) in enumerate(front) if i == 0 or a > best[i - 1]]


def present_part3(page: Page, r: Record, s: Settings) -> None:
    page.part("Part 3", "§3.3", "The arithmetic coder, and the quality levels 03 reads")
    one, many, plan = r.one, r.many, r.throughput.plan
    gap, exact = one.actual_bytes - one.ideal_bytes, one.roundtrip_exact and many.roundtrip_exact
    page.table(Table("Part 3 (§3.3). Arithmetic coder (level 0)", "§3.3", cols(
        "stream", ("symbols", "{:,}"), ("ideal bytes", "{:.2f}"), ("actual bytes", "{:,}"),
        ("actual - ideal", "{:+.2f}"), ("bit-exact", str)), [
        Row(["one whole context, one stream", one.symbols, Val(one.ideal_bytes, "ac_ideal_bytes"),
             Val(one.actual_bytes, "ac_actual_bytes"), gap, Val(one.roundtrip_exact, "ac_roundtrip_exact")],
            HANDOUT("coder", s)),
        Row([f"{many.contexts} contexts, codec bitstreams", many.symbols, Val(many.ideal_bytes, fmt="{:.1f}"),
             many.bytes, Val(many.bytes - many.ideal_bytes, fmt="{:+.1f}"), many.roundtrip_exact])],
        f"{SCRIPT}.coder_check", [
        f"The codec's bitstreams of {many.contexts} contexts, this run ({plan_words(r.throughput, many.contexts)}): "
        f"encode {many.encode_sym_per_s:,.0f} symbols/s, decode {many.decode_sym_per_s:,.0f} symbols/s. "
        + ("Lossless: the loss is only in quantization." if exact else "A round trip differs: a coder bug."),
        f"ideal = -sum log2 p under the coder's own tables; actual = the bytes written: just enough bits to name one "
        f"number inside the final interval (as wide as the message's probability), usually a bit or two over the "
        f"ideal, below it when that interval holds a short binary fraction (here {abs(gap):.2f} B "
        f"{'below' if gap < 0 else 'over'}). The codec's bitstreams add headers and {plural(plan.streams, 'stream')} "
        "per group."]))
    page.table(levels_table(r.codecs, s))


def levels_table(c: Codecs, s: Settings) -> Table:
    """The quality levels 03 reads, their accuracy and its noise; whether the last level's loss is real."""
    se = level_noise(c.levels, c.n_answers)
    se_of = {lv.level: e for lv, e in zip(c.levels, se)}
    top, last, ref = c.levels[0], c.levels[-1], handout_figure(f"level{c.levels[-1].level}", s)
    gap, noise = top.accuracy - last.accuracy, (se[0] ** 2 + se[-1] ** 2) ** 0.5
    note = (f"+- SE: binomial standard error over {c.n_answers:,} answers. Level {last.level} answers "
            f"{100 * abs(gap):.2f} points {'below' if gap >= 0 else 'above'} level {top.level}, " + (
                f"within two standard errors ({200 * noise:.2f}): the levels' accuracies are within noise."
                if abs(gap) <= 2 * noise else f"{abs(gap) / noise:.0f} standard errors: a real "
                f"{'loss' if gap > 0 else 'gain'}.") + (
                f" The handout's small model answered {ref.figure} at level {last.level}" + (
                    "; this record-world model tolerates coarse steps where Part 1b finds it insensitive, and the "
                    "levels scale the steps the search measured on it." if last.accuracy > float(ref.figure[:-1]) / 100
                    else "; ours answers no more.") if ref else ""))
    fp16 = c.by_key()["fp16"].bytes_per_token
    return table_of(
        "Quality levels (§4.2) of the measured codec (codec_study.codec_levels(), read by 03_streaming.py)", "§4.2",
        [Field("level (for 03)", "level {}", "levels[].level", get="level"), *level_fields("{:g}x", "{:.1f}"),
         Field("ratio to FP16", times2, get=lambda lv: fp16 / lv.bytes_per_token),
         Field("accuracy", pct2, "levels[].accuracy", get="accuracy"),
         Field("+- SE pts", "{:.2f}", get=lambda lv: 100 * se_of[lv.level])],
        c.levels, "codec_study.codec_study", [note], handout=lambda lv: handout_figure(f"level{lv.level}", s))


def level_fields(steps: str, size: str) -> list:
    """The columns every level table has: its steps (x level 0's), bytes/token, bits/value."""
    return [Field("steps", steps, get=lambda lv: kv.LEVEL_FACTOR ** lv.level),
            Field("bytes/token", size, "levels[].bytes_per_token", get="bytes_per_token"),
            Field("bits/value", "{:.2f}", "levels[].bits_per_value", get="bits_per_value")]


def present_exercise3(page: Page, r: Record, s: Settings) -> None:
    e = r.ex3
    page.exercise(3, "§3.3", "why every token of a group refers to one anchor, not to the previous token")
    damage = "makes the decoder reject the stream" if e.rejected else (
        f"spoils group{'s' * (len(e.spoiled_groups) != 1)} {', '.join(map(str, e.spoiled_groups)) or 'none'}"
        + " only" * (e.spoiled_groups == [e.damaged_group]))
    first, end, anchor = e.by_position[1], e.by_position[-1], [p.anchor for p in e.by_position[1:]]
    page.table(table_of(
        f"The {e.groups} groups of a context decode one at a time, last first, each from its own bytes: equal to the "
        f"full decode = {e.alone_equal}. One byte flipped in group {e.damaged_group}'s payload {damage}. A token needs "
        f"only its anchor; with deltas to the previous token, position p needs all p tokens before it (serial):",
        "§3.3", [Field("position in group", get="position"), Field("|error|/step, anchor", "{:.3f}", get="anchor"),
                 Field("|error|/step, previous-token chain", "{:.3f}", get="chain")], e.by_position,
        f"{SCRIPT}.exercise3",
        [f"The chain's error grows from {first.chain:.3f} to {end.chain:.3f} steps (positions {first.position}-"
         f"{end.position}), the anchor's stays at {min(anchor):.3f}-{max(anchor):.3f}: errors add up along the chain."
         if end.chain > max(first.chain, max(anchor)) else f"Here the chain's error does not grow past the anchor's "
         f"({first.chain:.3f} -> {end.chain:.3f} steps; anchor {min(anchor):.3f}-{max(anchor):.3f})."]))
    page.table(throughput_table(r.throughput))


LAYOUT_WORDS = {"group": "one stream per group", "K/V": "one stream per K/V of a group",
                "layer": "one stream per (layer, K/V) of a group",
                "channel": "one stream per (layer, K/V, channel) of a group"}


def plan_words(t: Throughput, contexts: int = 1) -> str:
    """The codec's streams for `contexts` contexts coded together, in words."""
    n = t.plan_streams * contexts
    return (f"{LAYOUT_WORDS[t.plan.layout]}, {plural(n, 'stream')} in {plural(contexts, 'context')} of "
            f"{t.tokens} tokens: the {kv.coder_for(n)} coder")


def plan_reason(t: Throughput) -> str:
    """Why the codec does not cut its groups finer: the next layout's cost, or too few streams."""
    finer = [p for p in t.plans if p.streams > t.plan.streams]
    if not finer:
        return ""
    p = finer[0]
    if p.added_share > kv.STREAM_BUDGET:
        return f"; {LAYOUT_WORDS[p.layout]} would add {p.added_share:.2%} (budget {kv.STREAM_BUDGET:.1%})"
    n = p.streams * t.plan_streams // t.plan.streams
    return (f"; {LAYOUT_WORDS[p.layout]} would add {p.added_share:.2%} and leave {n} streams a context, too few for "
            f"the parallel coder (it pays from {kv.PARALLEL_MIN_STREAMS})")


def times(x: float) -> str:
    """A speed ratio: '17.0x', and below 1 with two digits ('0.03x'), where '0.0x' would say nothing."""
    return f"{x:.1f}x" if x >= 1 else f"{x:.2f}x"


def throughput_table(t: Throughput) -> Table:
    """Exercise 3's measured table: each coder's symbols/s on the same symbols, and the parallel coder's
    added bytes at each stream count."""
    c, mega, cap = t.coder, lambda v: f"{v / 1e6:.2f}", kv.THROUGHPUT_MAX_STEPS
    rows = [Row(["serial (pure Python)", 1, c.serial_encode, c.serial_decode, 1.0, None, None], key="serial")] + [
        Row([f"parallel (numpy){', all' * (k == t.rows)}", k, e, d, d / c.serial_decode, a, a / c.one_stream_bytes],
            key="parallel" if k == t.rows else None)
        for k, e, d, a in zip(c.streams, c.parallel_encode, c.parallel_decode, c.added_bytes)]
    if c.constriction_decode is not None:
        rows.append(Row(["constriction's range coder", 1, c.constriction_encode, c.constriction_decode,
                         c.constriction_decode / c.serial_decode, None, None], key="constriction"))
    i1 = c.streams.index(min(c.streams))
    x_all, x_one = c.parallel_decode[-1] / c.serial_decode, c.parallel_decode[i1] / c.serial_decode
    notes = [f"The same {c.symbols:,} symbols (level 0, {t.what}) in {t.rows:,} rows: one per (context, layer, K/V, "
             f"channel), {t.tokens} tokens each; the parallel coder takes the rows in k runs, each run a stream. A "
             f"stream of more than {cap:,} symbols is timed on its first {cap:,}.",
             f"At all {t.rows:,} streams the parallel coder decodes {x_all:.1f}x the serial coder's symbols/s"
             + (f", constriction's compiled coder {c.constriction_decode / c.parallel_decode[-1]:.1f}x ours"
                if c.constriction_decode else "")
             + (f"; at {plural(c.streams[i1], 'stream')} it is {1 / x_one:.0f}x slower than the serial coder: a step "
                "costs a few dozen numpy calls however few streams share it" if x_one < 1 else "")
             + f". Each stream ends with its own flush and needs its length: {c.added_bytes[-1]:+,} bytes "
             f"({c.added_bytes[-1] / c.one_stream_bytes:+.2%}) at {t.rows:,} streams.",
             f"The codec's bitstreams: {plan_words(t)}; a group's payload is about {t.plan.group_bytes:,.0f} B"
             + (f", its extra streams add {t.plan.added_share:.2%} (expected)" if t.plan.streams > 1 else "")
             + plan_reason(t) + ".",
             f"On a GPU each stream is a thread (CacheGen's coder: one per (layer, channel)): {t.rows:,} streams "
             f"of {t.tokens} symbols decode in {t.tokens} sequential steps instead of {c.symbols:,}, "
             f"{c.symbols // t.tokens:,}x fewer, where numpy here still pays a few dozen calls a step."]
    return Table("Exercise 3 measured (§3.3): streams that decode independently, coded side by side (symbols/s, "
                 "wall clock, this run)", "§3.3",
                 cols("coder", ("streams", "{:,}"), ("encode M sym/s", mega, "coder_encode_sym_per_s.{row}"),
                      ("decode M sym/s", mega, "coder_decode_sym_per_s.{row}"), ("decode vs serial", times),
                      ("added bytes", "{:+,}"), ("added", "{:+.2%}")), rows, "kvcache.coder_throughput", notes,
                 json={"coder_parallel_streams": list(c.streams),
                       "coder_parallel_decode_sym_per_s": list(c.parallel_decode),
                       "coder_parallel_added_bytes": list(c.added_bytes)})


def present_exercise4(page: Page, r: Record, s: Settings) -> None:
    e, saving = r.ex4, r.ex4.fixed_bits - r.ex4.coded_bits_per_symbol
    page.exercise(4, "§3.3", "the entropy of a channel's quantized values, and a fixed-length code's bits")
    probs = ", ".join(f"{v:+d}: {p:g}" if v else f"0: {p:g}"
                      for v, p in sorted(s.ex4_probs.items(), key=lambda x: -x[1]))
    labels = {"entropy_bits": "entropy (bits/value)", "coded_bits_per_symbol": f"the coder on {s.ex4_samples:,} "
              "samples (bits/value)", "ideal_bits_per_symbol": "ideal under the coder's table (bits/value)",
              "fixed_bits": "fixed-length code (bits/value)", "roundtrip_exact": "round trip exact"}
    page.table(table_of(
        f"Entropy coding of {{{probs}}}", "§3.3", [Field("", get=0), Field("ours", lambda v: f"{v:.3f}" if
                                                   isinstance(v, float) else str(v), "exercise4.{row}", get=1)],
        {k: (label, getattr(e, k)) for k, label in labels.items()}, "kvcache.exercise4",
        [f"Arithmetic coding saves {saving:.2f} of the fixed-length code's {e.fixed_bits} bits per value ("
         f"{saving / e.fixed_bits:.0%}), within {abs(e.coded_bits_per_symbol - e.entropy_bits):.3f} bits of the "
         f"entropy." if saving > 0.005 else f"Arithmetic coding saves nothing over the fixed-length code's "
         f"{e.fixed_bits} bits per value here: the entropy is {e.entropy_bits:.3f} bits."],
        handout={k: handout_figure(f"ex4_{k}", s) for k in labels}))


# ---------------------------------------------------------------- a real model: --model smollm2
@dataclass
class Real:
    """02's measurements on a real LLaMA (codec_real's prose): Parts 1a, 1c and 2, and the levels."""
    name: str
    layers: int
    channels: int
    tokens: int
    n_calib: int
    n_eval: int
    locality: list            # LayerLocality per layer
    entropy: dict             # grouping -> bits per value
    codecs: Codecs            # rows' quality: {"nll", "kl", "agree"}
    rel_steps: list           # the measured steps / RMS, per third of the layers: [K, V]
    throughput: Throughput    # exercise 3 measured on the real model's KV


def compute_real(gguf, s: Settings, refit: bool) -> Real:
    """SmolLM2: the measured codec (codec_real: step search under a KL budget), the baselines and the
    recipe at the same size, all on the evaluation prose. Cached in code/checkpoints/ like the study it
    builds on (several minutes of forwards and codec fits); --refit measures again."""
    from common.gguf_llama import gguf_file
    path = gguf_file(gguf)
    ident = {**cr.study_ident(path), "measure": [REAL_ENTROPY_STEP, REAL_BASELINE_BITS, ZLIB_LEVEL,
                                                kv.RECIPE_GROUP_FACTOR, kv.MATCH_HALVINGS]}
    r = cs.cached_study("codec-smollm2-02", ident, lambda: measure_real(path, refit, s), refit, idle_threads)
    rows = [Codec(name, name.split(" ")[0].replace("-", "").lower(), b, q) for name, (b, q) in r["rows"].items()]
    levels = [Level(i, lv["bytes_per_token"], lv["bits_per_value"], kl=lv["kl"], agree=lv["agree"])
              for i, lv in enumerate(r["levels"])]
    d = r["delta_ratio"]
    locality = [LayerLocality(a[0], p[0], a[1], p[1]) for a, p in zip(d["anchor"], d["previous"])]
    coded = r["coded"]                  # the coded contexts at level 0, for exercise 3's measurement
    throughput = coder_throughput(kv.spec_from_dict(coded["spec"]), np.array(coded["q"]), s.coder_streams,
                                  plural(len(coded["q"]), "evaluation paragraph"))
    name = Path(r["info"]["path"]).stem     # the file's name, as 04 names it (its metadata's name is a run's)
    return Real(name, r["L"], r["C"], r["tokens"], r["n_calib"], r["n_eval"], locality, r["entropy"],
                Codecs(rows, levels, r["delta"]), r["rel_steps"], throughput)


def measure_real(path, refit: bool, s: Settings) -> dict:
    """The real model's measurements as cached: {"rows": {codec name: (bytes/token, quality)}, "levels", ...}."""
    prose = cr.Prose(path)
    study = cr.real_codec_study(path, refit=refit, prose=prose)
    Xc, Xe = prose.Xc, prose.Xe
    L, C, T = Xe.shape[2], Xe.shape[4], Xe.shape[1]
    rms = kv.kv_rms(Xc)
    delta = study["delta"]
    target = study["calib_bits"]["delta" if delta else "raw"]   # the measured codec's bits on calibration KV
    base = kv.match_bytes(lambda b: kv.fitted_bits(Xc, kv.recipe_steps(rms, b), True), target)
    rows = {c.name: (c.bytes_per_token, c.quality)
            for c in baseline_rows(Xc, Xe, prose.quality, s.real_baseline_bits, s.zlib_level)}
    recipe = cr.measure(prose, kv.fit_codec(Xc, kv.recipe_steps(rms, base), True))
    rows["recipe (anchor+delta, finer shallow)"] = (recipe["bytes_per_token"], recipe)
    level0 = study["levels"][0]
    rows[f"measured ({'anchor+delta' if delta else 'no deltas'})"] = (level0["bytes_per_token"], level0)
    raw_spec = kv.fit_codec(Xc, rms * s.real_entropy_step, False)
    ratios = delta_variance_ratios(Xe, kv.CODEC_GROUP)
    spec0 = kv.fit_codec(Xc, np.asarray(study["steps"]), delta)   # level 0's spec, as codec_real.fit made it
    return {"info": prose.info, "tokens": T, "n_eval": len(Xe), "n_calib": len(Xc), "L": L, "C": C,
            "delta_ratio": {ref: [[lv.ratio(k, ref) for k in KV_NAMES] for lv in ratios]
                            for ref in ("anchor", "previous")},
            "rows": rows, "rel_steps": study["rel_steps"], "delta": bool(delta), "calib_bits": study["calib_bits"],
            "levels": study["levels"],
            "entropy": grouping_entropy(kv.quantize(Xc, raw_spec), kv.quantize(Xe, raw_spec)),
            "coded": {"spec": kv.spec_to_dict(spec0), "q": kv.quantize(Xe[:cr.REAL_CODED], spec0)}}


def present_real(page: Page, r: Real, s: Settings) -> None:
    page.say(f"{r.name} ({r.layers} layers, {r.channels // 64} KV heads x 64): {r.n_calib} calibration and "
             f"{r.n_eval} evaluation paragraphs of the project's own prose, {r.tokens} context tokens each.")
    page.data(model=r.name)
    page.part("Part 1", "§3.2", f"CacheGen's observations on {r.name}")
    ratio = {to: np.array([[lv.ratio(k, to) for k in KV_NAMES] for lv in r.locality]) for to in ("anchor", "previous")}
    thirds = [np.flatnonzero(kv.layer_groups(r.layers) == i) for i in range(3)]
    page.table(Table(
        "Part 1a (§3.2, real model). Variance of raw values over variance of deltas, by thirds of the layers\n(>1: "
        "deltas smaller)", "§3.2", cols("", ("anchor: mean", times2), "range", ("previous: mean", times2), "range"),
        [Row([f"layers {g[0]}-{g[-1]} {KV_NAMES[k]}", *(f for x in (ratio["anchor"][g, k], ratio["previous"][g, k])
                                                        for f in (x.mean(), f"{x.min():.2f}-{x.max():.2f}x"))],
             HANDOUT("delta_ratio", s) if i == k == 0 else None) for i, g in enumerate(thirds) for k in range(2)],
        f"{SCRIPT}.delta_variance_ratios", json={"delta_var_ratio": r.locality}))
    page.table(entropy_table(r.entropy, f"Part 1c (§3.2, real model). Entropy at steps of {s.real_entropy_step:g} "
                                        f"x RMS, tables fitted on calibration prose"))
    page.part("Part 2", "§3.4", f"The codec table on {r.name}, and its quality levels")
    fp16 = r.codecs.by_key()["fp16"].bytes_per_token
    page.table(Table(
        f"Part 2 (§3.4, real model). Continuations of {cr.REAL_CONTINUATION} tokens attending to the decoded context "
        f"KV\n(coded rows: bytes of {cr.REAL_CODED} contexts really coded, bit-exact round trip checked)", "§3.4",
        cols("codec", ("bytes/token", "{:,.0f}", "bytes_{row}"), ("ratio to FP16", times2),
             ("NLL (nats/token)", "{:.4f}", "nll_{row}"), ("KL from FP16", "{:.4f}", "kl_{row}"),
             ("top-1 = FP16's", pct1, "top1_agree_{row}")),
        [Row([*codec_cells(c, fp16), *(c.quality[q] for q in ("nll", "kl", "agree"))], key=c.key)
         for c in r.codecs.codecs], f"{SCRIPT}.measure_real",
        ["Measured steps / RMS (shallow, middle, deep thirds; K / V): " + ", ".join(f"{k:.3g} / {v:.3g}" for k, v in
         r.rel_steps) + f"; KL from FP16 kept below {cr.REAL_MAX_KL} nats/token on calibration prose; recipe sized to "
         "the same bytes."]))
    page.table(headline_table(r.codecs, r.name, f"{SCRIPT}.measure_real", s))
    page.table(table_of(
        "Quality levels (§4.2) of the measured codec on the real model (codec_real.real_codec_levels(), read by 03)",
        "§4.2", [Field("level (03 Part 2c)", get=lambda lv: f"level {lv.level}"), *level_fields("{:.3g}x", "{:,.0f}"),
                 Field("KL from FP16", "{:.4f}", "levels[].kl", get="kl"),
                 Field("top-1 = FP16's", pct1, "levels[].agree", get="agree")],
        r.codecs.levels, "codec_real.fit"))
    page.exercise(3, "§3.3", f"streams that decode independently, side by side: the coders on {r.name}'s KV")
    page.table(throughput_table(r.throughput))


def parse(argv):
    p = Parser(__doc__)
    p.add_argument("--sensitivity-step", type=positive_float, default=SENSITIVITY_STEP,
                   help="Part 1b: coarse step, in units of a layer's RMS")
    p.add_argument("--refit", action="store_true", help="redo the codec's step search and tables (cached otherwise)")
    p.add_argument("--model", choices=["record", "smollm2"], default="record",
                   help="record: the record-world model (every part); smollm2: Parts 1a, 1c, 2 and exercise 3's "
                        "coders on SmolLM2-135M")
    p.add_argument("--gguf", metavar="PATH", help="with --model smollm2: another LLaMA GGUF file")
    return p.parse_args(argv)


def settings(args) -> Settings:
    """The run's settings: the flags, and the constants above as they are now (a student's edit included)."""
    return settings_from(Settings, args, sensitivity_steps=SENSITIVITY_STEPS, entropy_level=ENTROPY_LEVEL,
                         zlib_level=ZLIB_LEVEL, baseline_bits=BASELINE_BITS, ex3_contexts=EX3_CONTEXTS,
                         coder_streams=CODER_STREAMS,
                         ex4_probs=EX4_PROBS, ex4_samples=EX4_SAMPLES, real_entropy_step=REAL_ENTROPY_STEP,
                         real_baseline_bits=REAL_BASELINE_BITS)


TITLE = "CacheGen part one: compress KV like video"


def main(argv=None):
    args = parse(argv)
    s = settings(args)
    if s.model == "smollm2":  # its long forwards run on the idle cores (compute_real: idle_threads)
        from common.gguf_llama import smollm2_or_explain
        gguf = smollm2_or_explain(s.gguf)
        if gguf is None:
            return None
        defaults = dataclasses.replace(shipped_defaults(Settings, globals()), model="smollm2")
        page = Page("02_smollm2", TITLE + ", on a real LLaMA", "§3", s, defaults, plot=not args.no_plot)
        present_real(page, compute_real(gguf, s, args.refit), s)
        return page.finish(args.json)
    page = Page("02", TITLE, "§3", s, shipped_defaults(Settings, globals()), plot=not args.no_plot)
    with single_thread():  # the record model's batches are tiny: one thread is faster, and cores may be shared
        r = compute(s, args.refit)
    for part in (present_part1, present_part2, present_part3, present_exercise3, present_exercise4):
        part(page, r, s)
    return page.finish(args.json)


if __name__ == "__main__":
    main()
