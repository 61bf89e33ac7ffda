"""02 -- CacheGen part one (handout §3): compress KV like video, measured on the record-world model.

    python code/lecture27/02_cachegen_codec.py                  # Parts 1-3, the levels, exercises 3-4, two figures
    python code/lecture27/02_cachegen_codec.py --json out.json  # + headline figures as JSON
    python code/lecture27/02_cachegen_codec.py --sensitivity-step 0.5   # Part 1b with finer coarse steps
    python code/lecture27/02_cachegen_codec.py --refit          # redo the codec's step search and tables
    python code/lecture27/02_cachegen_codec.py --model smollm2  # Parts 1a, 1c, 2 on a real model (SmolLM2-135M)

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
        round trip, throughput. Then the four quality levels 03_streaming.py reads, exercises 3 and 4.

Accuracy of a codec: the question's tokens attend to the decoded context KV instead of the exact one.
The codec is fitted once per model on calibration documents (one seed) and evaluated on other
documents (another seed); its step search and tables are cached in code/checkpoints/ (computed again
when a setting below changes, or with --refit).
Every figure is computed here; the "handout" column is the reference the handout prints.

Settings of the codec itself live in the library, because 03_streaming.py reads the same codec:
  kvcache.py      CODEC_GROUP (tokens per anchor group), ANCHOR_BITS, LEVEL_FACTOR and N_LEVELS (the
                  quality levels), RECIPE_GROUP_FACTOR (the published recipe's step growth)
  codec_study.py  MEASURE_TOL and STEP_* (the step search), CODEC_N_CALIB / CODEC_N_EVAL / CODEC_N_CODED
                  (documents) and their seeds
  codec_real.py   REAL_MAX_KL (the real model's quality budget), REAL_CONTEXT / REAL_CONTINUATION
The settings at the top of this file are the measurements' own.
"""
from __future__ import annotations

import sys
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

import codec_real as cr  # noqa: E402
import codec_study as cs  # noqa: E402
import kvcache as kv  # noqa: E402
import blend_world as bw  # noqa: E402
from common.cli import Parser, figure_path, positive_float, say, table, write_json  # noqa: E402
from common.llama import idle_threads, single_thread  # noqa: E402

SENSITIVITY_STEPS = (1, 2, 4, 8)  # Part 1b: coarse steps for one layer's K+V, in units of its RMS
SENSITIVITY_STEP = 4.0      # Part 1b: the coarse step for K alone and V alone
ENTROPY_LEVEL = 0           # Part 1c: the values quantized at this level's steps
ZLIB_LEVEL = 9              # Part 2: zlib's best compression
EX4_PROBS = {0: 0.70, 1: 0.12, -1: 0.12, 2: 0.03, -2: 0.03}   # exercise 4: a distribution of quantized values
EX4_SAMPLES = 100_000       # exercise 4: symbols drawn from EX4_PROBS
EX3_CONTEXTS = 200          # exercise 3: contexts for the error-by-position comparison
FP16_BYTES = 2

# The handout's figures, printed beside ours (reference only; nothing below is computed from them)
HANDOUT = {
    "delta_ratio": "2.4-2.9x (LLaMA)",         # §3.2: deltas' variance 2.4-2.9x smaller
    "entropy": "up to 53% below one global table (LLaMA)",   # §3.3
    "fp16": "512 B", "zlib": "1.08x", "6bit_acc": "no loss", "recipe": "worst accuracy",
    "measured": "no loss; 1.66x < 8-bit, 1.28x < 6-bit", "vs_8bit": "1.66x", "vs_6bit": "1.28x",
    "coder": "a fraction of a byte", "level3": "74%",
    "ex4_entropy": "1.40", "ex4_fixed": "3",
    # §3.4: CacheGen on LLaMA, and the slides' ranges
    "cachegen_vs_8bit": "3.5-4.3x", "slides_kv": "3-10x smaller KV", "slides_transfer": "2-8x faster transfer",
}
HANDOUT_EX4_PROBS = {0: 0.70, 1: 0.12, -1: 0.12, 2: 0.03, -2: 0.03}   # the distribution of exercise 4
KV_NAMES = ("K", "V")


# ------------------------------------------------------------------------------------- calculators
def delta_variance_ratios(X, group):
    """Part 1a. X (N, T, L, 2, C). Per (layer, K/V): sum of per-channel variances of the raw values over
    that of the deltas to the group's anchor (non-anchor tokens) and to the previous token."""
    T = X.shape[1]
    anchors = np.arange(T) % group == 0
    owner = np.arange(T) // group * group
    raw = X.var(axis=(0, 1)).sum(-1)
    to_anchor = (X - X[:, owner])[:, ~anchors].var(axis=(0, 1)).sum(-1)
    to_prev = (X[:, 1:] - X[:, :-1]).var(axis=(0, 1)).sum(-1)
    return {"anchor": raw / to_anchor, "previous": raw / to_prev}


def layer_sensitivity(model, X, ev, rms, kv_steps, one_step):
    """Part 1b: one layer's K and V rounded to steps of s x RMS for each s in kv_steps, and its K alone
    or V alone at one_step x RMS; all other layers exact. -> {(layer, "K+V" | "K" | "V", s): accuracy}."""
    out = {}
    for layer in range(X.shape[2]):
        for name, kinds, rel_steps in (("K+V", [0, 1], kv_steps), ("K", [0], [one_step]), ("V", [1], [one_step])):
            for s in rel_steps:
                Xq = X.copy()
                for k in kinds:
                    step = np.float32(s * rms[layer, k])
                    Xq[:, :, layer, k] = np.rint(X[:, :, layer, k] / step) * step
                out[(layer, name, s)] = cs.answer_accuracy(model, Xq, *ev)["acc"]
    return out


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
        tables = kv.make_tables(counts + (counts.sum(1, keepdims=True) == 0), [K] * n)
        bits = kv.ideal_bits((Qe - lo).ravel(), tables, np.broadcast_to(gid, Qe.shape).ravel())
        out[name] = bits / Qe.size
    return out


def baseline_rows(Xc, Xe, quality, bits=(8, 6)):
    """Part 2's baselines: FP16, zlib on FP16, and n-bit fixed-length codes (one step per channel from the
    calibration contexts' absmax). quality(decoded KV) -> the codec's quality on the evaluation contexts.
    Returns {name: (bytes/token, quality)}."""
    T, L, C = Xe.shape[1], Xe.shape[2], Xe.shape[4]
    fp16 = Xe.astype(np.float16)
    q16 = quality(fp16.astype(np.float32))
    # zlib on each context's FP16 bytes in the cache's own order (layer, K/V, head, token, dim)
    per_ctx = [np.ascontiguousarray(x.transpose(1, 2, 0, 3)).tobytes() for x in fp16]
    zbytes = sum(len(zlib.compress(b, ZLIB_LEVEL)) for b in per_ctx) / (len(per_ctx) * T)
    rows = {"FP16": (L * 2 * C * FP16_BYTES, q16), "zlib on FP16": (zbytes, q16)}
    absmax = np.abs(Xc).max(axis=(0, 1))
    for b in bits:
        rows[f"{b}-bit"] = (L * 2 * C * b / 8, quality(kv.uniform_quantize(Xe, b, absmax / ((1 << (b - 1)) - 1))))
    return rows


def coder_check(spec, Xe, n_contexts):
    """Part 3: one whole context's symbols as one arithmetic-coded stream: actual vs ideal bytes and a
    bit-exact round trip; then the codec's bitstreams of n_contexts contexts, timed."""
    syms, ids = kv._symbols(kv.quantize(Xe[0], spec), spec)
    syms, ids = syms.ravel(), ids.ravel()
    data = kv.encode(syms, list(spec.tables), ids)
    back = kv.decode(data, list(spec.tables), syms.size, ids)
    one = {"symbols": syms.size, "ideal_bytes": kv.ideal_bits(syms, list(spec.tables), ids) / 8,
           "actual_bytes": len(data), "roundtrip_exact": bool(np.array_equal(back, syms))}
    t0 = time.perf_counter()
    streams = [kv.codec_encode(x, spec) for x in Xe[:n_contexts]]
    t1 = time.perf_counter()
    decoded = [kv.codec_decode(d, spec) for d in streams]
    t2 = time.perf_counter()
    n_sym = n_contexts * Xe[0].size
    exact = all(np.array_equal(q, kv.quantize(x, spec)) for q, x in zip(decoded, Xe))
    ideal = sum(kv.codec_bits(spec, x[None]) for x in Xe[:n_contexts]) / 8
    return one, {"contexts": n_contexts, "symbols": n_sym, "encode_sym_per_s": n_sym / (t1 - t0),
                 "decode_sym_per_s": n_sym / (t2 - t1), "bytes": sum(map(len, streams)), "ideal_bytes": ideal,
                 "roundtrip_exact": exact}


def exercise3(spec_delta, Xe, n):
    """Exercise 3. (a) every group decodes alone from its own bytes, in any order; a damaged group
    spoils only itself. (b) error by position in the group: deltas to the (decoded) anchor vs a chain of
    deltas to the previous token, each quantized with the same steps (decoded by summing the chain)."""
    x = Xe[0]
    data = kv.codec_encode(x, spec_delta)
    full = kv.codec_decode(data, spec_delta)
    G, T = spec_delta.group, x.shape[0]
    n_groups = -(-T // G)
    alone = all(np.array_equal(kv.codec_decode(data, spec_delta, groups=[g])[g * G:(g + 1) * G], full[g * G:(g + 1) * G])
                for g in reversed(range(n_groups)))
    h = kv.codec_header(data)
    bad = bytearray(data)
    start = h["payload_start"] + h["group_bytes"][0]
    bad[start + h["group_bytes"][1] // 2] ^= 0xFF         # one byte in the middle of group 1
    try:
        damaged = kv.codec_decode(bytes(bad), spec_delta)
        spoiled = [g for g in range(n_groups) if not np.array_equal(damaged[g * G:(g + 1) * G], full[g * G:(g + 1) * G])]
    except kv.CorruptStream:
        spoiled = ["stream rejected"]
    # (b) anchor-relative (the codec) vs previous-token chain
    X = Xe[:n]
    step = spec_delta.steps[:, :, None]
    anchor_err = np.abs(kv.dequantize(kv.quantize(X, spec_delta), spec_delta) - X)
    chain = np.empty_like(X)
    for t in range(T):
        if t % G == 0:
            chain[:, t] = kv.dequantize(kv.quantize(X, spec_delta), spec_delta)[:, t]   # the same 8-bit anchor
        else:
            chain[:, t] = chain[:, t - 1] + np.rint((X[:, t] - X[:, t - 1]) / step) * step
    chain_err = np.abs(chain - X)
    pos = np.arange(T) % G
    by_pos = [(int(p), float((anchor_err[:, pos == p] / step).mean()), float((chain_err[:, pos == p] / step).mean()))
              for p in range(G)]
    return {"groups": n_groups, "alone_equal": alone, "damaged_group": 1, "spoiled_groups": spoiled,
            "error_by_position": by_pos}


def compute(args):
    world = cs.record_world()
    model = world["model"]
    study = cs.record_codec_study(refit=args.refit)
    calib = world["docs"](cs.CODEC_N_CALIB, cs.CODEC_CALIB_SEED)
    ev = world["docs"](cs.CODEC_N_EVAL, cs.CODEC_EVAL_SEED)
    Xc, Xe = cs.context_kv(model, calib[0]), cs.context_kv(model, ev[0])
    T = Xe.shape[1]
    specs = [kv.spec_from_dict(d) for d in study["specs"]]
    rms = kv.kv_rms(Xc)
    r = {"study": study, "tokens": T, "values_per_token": int(np.prod(Xe.shape[2:]))}
    r["delta_ratio"] = delta_variance_ratios(Xe, kv.CODEC_GROUP)
    r["sens_steps"] = sorted({*SENSITIVITY_STEPS, args.sensitivity_step})
    r["sensitivity"] = layer_sensitivity(model, Xe, ev[1:], rms, r["sens_steps"], args.sensitivity_step)
    raw_spec = kv.fit_codec(Xc, specs[ENTROPY_LEVEL].steps, False)
    r["entropy"] = grouping_entropy(kv.quantize(Xc, raw_spec), kv.quantize(Xe, raw_spec))
    r["baselines"] = baseline_rows(Xc, Xe, lambda X: cs.answer_accuracy(model, X, *ev[1:])["acc"])
    r["coder_one"], r["coder_many"] = coder_check(specs[0], Xe, cs.CODEC_N_CODED)
    r["ex3"] = exercise3(kv.fit_codec(Xc, specs[0].steps, True), Xe, EX3_CONTEXTS)
    r["ex4"] = exercise4()
    return r


# ------------------------------------------------------------------------------------------ output
def codec_rows(r):
    """Every codec of Part 2 and the levels: (name, bytes/token, accuracy, handout)."""
    s = r["study"]
    refs = {"FP16": HANDOUT["fp16"], "zlib on FP16": HANDOUT["zlib"], "6-bit": HANDOUT["6bit_acc"]}
    rows = [(name, b, a, refs.get(name, "")) for name, (b, a) in r["baselines"].items()]
    rows.append(("recipe (anchor+delta, finer shallow)", s["recipe"]["bytes_per_token"], s["recipe"]["accuracy"],
                 HANDOUT["recipe"]))
    for v in ("delta", "raw"):
        m = s["variants"][v]
        tag = "measured" if v == ("delta" if s["delta"] else "raw") else "  same steps"
        rows.append((f"{tag} ({'anchor+delta' if v == 'delta' else 'no deltas'})", m["bytes_per_token"],
                     m["accuracy"], HANDOUT["measured"] if tag == "measured" else ""))
    return rows


def print_part1(r, args):
    s = r["study"]
    L = len(s["rms"])
    d = r["delta_ratio"]
    rows = [[f"layer {l} {KV_NAMES[k]}", f"{d['anchor'][l, k]:.2f}x", f"{d['previous'][l, k]:.2f}x",
             HANDOUT["delta_ratio"] if l == 0 and k == 0 else ""] for l in range(L) for k in range(2)]
    print(table(["", "raw/delta var (anchor)", "raw/delta var (previous)", "CacheGen"], rows,
                "Part 1a (§3.2). Token locality: variance of raw values over variance of deltas (>1: deltas are smaller)"))
    sens, a = r["sensitivity"], args.sensitivity_step
    rows = [[f"layer {l}", *(f"{100 * sens[(l, 'K+V', x)]:.1f}%" for x in r["sens_steps"]),
             f"{100 * sens[(l, 'K', a)]:.1f}%", f"{100 * sens[(l, 'V', a)]:.1f}%",
             " / ".join(f"{x:.3g}" for x in s["steps_over_rms"][l])] for l in range(L)]
    print()
    print(table(["", *(f"K+V @{x:g}" for x in r["sens_steps"]), f"K @{a:g}", f"V @{a:g}",
                 "measured steps K / V"], rows,
                f"Part 1b (§3.2). Layer sensitivity: one layer rounded to steps of @ x its RMS, the rest exact (FP16: "
                f"{100 * s['acc_fp16']:.2f}%);\nlast column: the coarsest steps (x RMS) the search kept. "
                f"CacheGen: shallow layers are the most sensitive."))
    print()
    print_entropy(r["entropy"], f"Part 1c (§3.2, §3.3). Entropy of the values quantized at level {ENTROPY_LEVEL}'s "
                  f"steps, tables fitted on calibration contexts,\nmeasured on evaluation contexts. CacheGen: "
                  f"{HANDOUT['entropy']}; by token position hardly helps.")


def print_entropy(ent, title):
    g0 = ent["one global table"]
    rows = [[name, f"{b:.3f}", f"{100 * (1 - b / g0):+.1f}%" if name != "one global table" else ""]
            for name, b in ent.items()]
    print(table(["tables", "bits/value", "smaller than global"], rows, title))


def print_part2(r):
    s = r["study"]
    fp16_b, acc16 = r["baselines"]["FP16"]
    rows = [[name, f"{b:.1f}", f"{fp16_b / b:.2f}x", f"{100 * a:.2f}%", h] for name, b, a, h in codec_rows(r)]
    print()
    print(table(["codec", "bytes/token", "ratio to FP16", "accuracy", "handout"], rows,
                "Part 2 (§3.4). The codec table (accuracy on unseen records; the arithmetic-coded rows count\n"
                f"every byte of the bitstream, header included, on {cs.CODEC_N_CODED} coded contexts)"))
    m = s["variants"]["delta" if s["delta"] else "raw"]
    b8, b6 = r["baselines"]["8-bit"][0], r["baselines"]["6-bit"][0]
    per_token = {k: s["calib_bits"][k] / 8 / s["n_calib"] / r["tokens"] for k in ("delta", "raw")}
    say(f"Measured codec: {b8 / m['bytes_per_token']:.2f}x smaller than 8-bit (handout {HANDOUT['vs_8bit']}), "
        f"{b6 / m['bytes_per_token']:.2f}x smaller than 6-bit (handout {HANDOUT['vs_6bit']}), accuracy "
        f"{100 * (m['accuracy'] - acc16):+.2f} points vs FP16.")
    say(f"Mode chosen on calibration bits: {'anchor+delta' if s['delta'] else 'no deltas'} (calibration: "
        f"{per_token['delta']:.1f} vs {per_token['raw']:.1f} B/token with / without deltas). Recipe: steps / RMS by "
        f"layer {', '.join(f'{x[0]:.3g}' for x in s['recipe']['steps_over_rms'])}, sized to the measured codec's bytes.")
    print_headline(b8, fp16_b, m["bytes_per_token"], "record-world model")


def print_headline(b8, fp16_b, measured_b, model_name):
    """§3.4's headline: CacheGen's size against 8-bit quantization and the slides' ranges, ours beside them."""
    print(table(["§3.4 headline", "ours", "CacheGen / slides"], [
        ["smaller than 8-bit quantization", f"{b8 / measured_b:.2f}x", f"{HANDOUT['cachegen_vs_8bit']} (LLaMA)"],
        ["KV smaller than FP16", f"{fp16_b / measured_b:.2f}x", HANDOUT["slides_kv"]],
        ["transfer faster than FP16 KV, same link", f"{fp16_b / measured_b:.2f}x", HANDOUT["slides_transfer"]]],
        f"  {model_name}: the measured codec (level 0) beside CacheGen's figures"))
    say("  At a fixed bandwidth transfer time is bytes / bandwidth, so our transfer speed-up is the size ratio; "
        "the slides' transfer range is end to end (decoding and network included).")


def print_part3(r):
    one, many = r["coder_one"], r["coder_many"]
    print()
    rows = [["one whole context, one stream", f"{one['symbols']:,}", f"{one['ideal_bytes']:.2f}",
             f"{one['actual_bytes']:,}", f"{one['actual_bytes'] - one['ideal_bytes']:+.2f}",
             str(one["roundtrip_exact"]), HANDOUT["coder"]],
            [f"{many['contexts']} contexts, codec bitstreams", f"{many['symbols']:,}", f"{many['ideal_bytes']:.1f}",
             f"{many['bytes']:,}", f"{many['bytes'] - many['ideal_bytes']:+.1f}", str(many["roundtrip_exact"]),
             "(headers, groups)"]]
    print(table(["stream", "symbols", "ideal bytes", "actual bytes", "actual - ideal",
                 "bit-exact", "handout"], rows, "Part 3 (§3.3). Arithmetic coder (level 0)"))
    say(f"Coder throughput (pure Python, this run): encode {many['encode_sym_per_s']:,.0f} symbols/s, "
        f"decode {many['decode_sym_per_s']:,.0f} symbols/s. Lossless: the loss is only in quantization.")
    say(f"  ideal = -sum log2 p of the symbols under the coder's own tables, in bytes; actual = the whole bytes "
        f"written. The coder ends by writing just enough bits to name one number inside its final interval (whose "
        f"width is the message's probability): usually a bit or two over the ideal, and a fraction of a byte below "
        f"it when that interval holds a short binary fraction (here {one['actual_bytes'] - one['ideal_bytes']:+.2f} "
        f"B). The codec's bitstreams add headers and one stream per group.")


def handout_share(text: str) -> float:
    """"74%" -> 0.74 (a handout figure, for a comparison in the printed explanation only)."""
    return float(text.rstrip("%")) / 100


def level_noise(levels, n_answers: int) -> list[float]:
    """Binomial standard error of each level's accuracy over n_answers answers (answers of one document
    share its context, so this is a lower bound on the noise)."""
    return [(lv["accuracy"] * (1 - lv["accuracy"]) / n_answers) ** 0.5 for lv in levels]


def print_levels(r):
    fp16_b = r["baselines"]["FP16"][0]
    levels = r["study"]["levels"]
    n = r["study"]["n_eval"] * bw.N_RECORDS
    se = level_noise(levels, n)
    print()
    rows = [[f"level {lv['level']}", f"{kv.LEVEL_FACTOR ** lv['level']:g}x", f"{lv['bytes_per_token']:.1f}",
             f"{lv['bits_per_value']:.2f}", f"{fp16_b / lv['bytes_per_token']:.2f}x", f"{100 * lv['accuracy']:.2f}%",
             f"{100 * e:.2f}", HANDOUT["level3"] if lv["level"] == 3 else ""] for lv, e in zip(levels, se)]
    print(table(["level (for 03)", "steps", "bytes/token", "bits/value", "ratio to FP16", "accuracy", "+- SE pts",
                 "handout"], rows,
                "Quality levels (§4.2) of the measured codec (codec_study.codec_levels(), read by 03_streaming.py)"))
    top, last = levels[0], levels[-1]
    gap = top["accuracy"] - last["accuracy"]
    noise = (se[0] ** 2 + se[-1] ** 2) ** 0.5
    say(f"  +- SE: binomial standard error over {n:,} answers. Level {last['level']} answers "
        f"{100 * gap:.2f} points below level {top['level']}, "
        + (f"within two standard errors ({200 * noise:.2f}): the levels' accuracies are within noise"
           if gap <= 2 * noise else f"{gap / noise:.0f} standard errors: a real loss")
        + f". The handout's small model answered {HANDOUT['level3']} at level 3"
        + ("; this record-world model tolerates coarse steps where Part 1b finds it insensitive, and the levels "
           "scale the steps the search measured on it." if last["accuracy"] > handout_share(HANDOUT["level3"])
           else "."))


def print_exercise3(r):
    e3 = r["ex3"]
    print()
    say(f"Exercise 3 (§3.3, §10). The {e3['groups']} groups of a context decode one at a time, last first, each "
        f"from its own bytes: equal to the full decode = {e3['alone_equal']}. One byte flipped in group "
        f"{e3['damaged_group']}'s payload spoils groups {e3['spoiled_groups']} only. A token needs only its anchor; "
        f"with deltas to the previous token, position p needs all p tokens before it (serial), and errors add up "
        f"along the chain:", indent=4)
    rows = [[p, f"{a:.3f}", f"{c:.3f}"] for p, a, c in e3["error_by_position"]]
    print(table(["position in group", "|error|/step, anchor", "|error|/step, previous-token chain"], rows))


def exercise4() -> dict:
    """Exercise 4 on EX4_PROBS: entropy, the coder's bits per value on EX4_SAMPLES samples, the fixed code."""
    return kv.exercise4(EX4_PROBS, EX4_SAMPLES)


def print_exercise4(e4):
    same = EX4_PROBS == HANDOUT_EX4_PROBS
    probs = ", ".join(f"{v:+d}: {p:g}" if v else f"0: {p:g}" for v, p in sorted(EX4_PROBS.items(), key=lambda vp: -vp[1]))
    print()
    say(f"Exercise 4 (§3.3, §10). Entropy of {{{probs}}} = {e4['entropy_bits']:.3f} bits (handout "
        f"{HANDOUT['ex4_entropy'] if same else '-'}); the coder spends {e4['coded_bits_per_symbol']:.3f} bits/value on "
        f"{EX4_SAMPLES:,} samples (ideal under its table {e4['ideal_bits_per_symbol']:.3f}); a fixed-length code needs "
        f"{e4['fixed_bits']} bits (handout {HANDOUT['ex4_fixed'] if same else '-'}); round trip exact: "
        f"{e4['roundtrip_exact']}.", indent=4)


def report(r, args):
    s = r["study"]
    say(f"Record-world model: {s['n_calib']} calibration documents (seed {cs.CODEC_CALIB_SEED}), {s['n_eval']} "
        f"evaluation documents (seed {cs.CODEC_EVAL_SEED}), {r['tokens']} context tokens each, "
        f"{r['values_per_token']} K/V values per token.")
    print()
    print_part1(r, args)
    print_part2(r)
    print_part3(r)
    print_levels(r)
    print_exercise3(r)
    print_exercise4(r["ex4"])


def figures(r):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    d, L = r["delta_ratio"], len(r["study"]["rms"])
    fig, ax = plt.subplots(figsize=(7, 3.6))
    x = np.arange(L)
    for i, (ref, k) in enumerate([(ref, k) for ref in ("anchor", "previous") for k in range(2)]):
        ax.bar(x + (i - 1.5) * 0.2, d[ref][:, k], 0.2, label=f"{KV_NAMES[k]}, delta to {ref}")
    ax.axhspan(2.4, 2.9, color="0.85", label="CacheGen on LLaMA: 2.4-2.9x", zorder=0)
    ax.axhline(1, color="k", lw=0.8)
    ax.set_xticks(x, [f"layer {l}" for l in range(L)])
    ax.set_ylabel("var(raw) / var(delta)")
    ax.set_title("Token locality on the record-world model (>1: deltas smaller)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    p1 = figure_path("02_delta_variance.png")
    fig.savefig(p1, dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 5))
    pts = [(n, b, a) for n, b, a, _ in codec_rows(r)] + [(f"level {lv['level']}", lv["bytes_per_token"], lv["accuracy"])
                                                        for lv in r["study"]["levels"][1:]]
    markers = "osD^v<>pP*Xh"
    for i, (n, b, a) in enumerate(pts):
        ax.scatter(b, 100 * a, s=30, marker=markers[i % len(markers)], label=f"{n.strip()}: {b:.0f} B, {100 * a:.1f}%")
    front, best = [], -1
    for n, b, a in sorted(pts, key=lambda p: (p[1], -p[2])):
        if a > best:
            front.append((b, 100 * a))
            best = a
    ax.plot(*zip(*front), "k--", lw=0.8, label="Pareto front")
    ax.set_xscale("log")
    ticks = [8, 16, 32, 64, 128, 256, 512]
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("bytes / token (log)")
    ax.set_ylabel("answer accuracy (%)")
    ax.set_title("Every codec on the record-world model")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    p2 = figure_path("02_codec_pareto.png")
    fig.savefig(p2, dpi=120)
    plt.close(fig)
    print()
    for path in (p1, p2):
        print(f"figure: {path}")


def to_json(r, args):
    s, L = r["study"], len(r["study"]["rms"])
    d = r["delta_ratio"]
    out = {"delta_var_ratio": [{f"{KV_NAMES[k]}_{ref}": float(d[ref][l, k]) for ref in d for k in range(2)}
                               for l in range(L)],
           "layer_sensitivity_acc": [float(r["sensitivity"][(l, "K+V", args.sensitivity_step)]) for l in range(L)],
           "layer_sensitivity_step_over_rms": args.sensitivity_step,
           "layer_sensitivity_detail": [{f"{n}@{x:g}": float(a) for (ll, n, x), a in r["sensitivity"].items() if ll == l}
                                        for l in range(L)],
           "measured_steps_over_rms": s["steps_over_rms"],
           "entropy_bits": {k: float(v) for k, v in r["entropy"].items()},
           "fp16_bytes_per_token": r["baselines"]["FP16"][0], "acc_fp16": r["baselines"]["FP16"][1],
           "zlib_ratio": r["baselines"]["FP16"][0] / r["baselines"]["zlib on FP16"][0]}
    for key, name in (("8bit", "8-bit"), ("6bit", "6-bit")):
        out[f"bytes_{key}"], out[f"acc_{key}"] = r["baselines"][name]
    m = s["variants"]["delta" if s["delta"] else "raw"]
    out.update(bytes_recipe=s["recipe"]["bytes_per_token"], acc_recipe=s["recipe"]["accuracy"],
               bytes_measured=m["bytes_per_token"], acc_measured=m["accuracy"], measured_uses_deltas=s["delta"],
               ac_ideal_bytes=r["coder_one"]["ideal_bytes"], ac_actual_bytes=r["coder_one"]["actual_bytes"],
               ac_roundtrip_exact=r["coder_one"]["roundtrip_exact"],
               coder_encode_sym_per_s=r["coder_many"]["encode_sym_per_s"],
               coder_decode_sym_per_s=r["coder_many"]["decode_sym_per_s"],
               levels=[{"level": lv["level"], "bytes_per_token": lv["bytes_per_token"],
                        "bits_per_value": lv["bits_per_value"], "accuracy": lv["accuracy"]} for lv in s["levels"]],
               exercise4=r["ex4"])
    return out


# ---------------------------------------------------------------- a real model: --model smollm2
REAL_ENTROPY_STEP = 0.25    # Part 1c on the real model: values quantized at this x each layer's RMS


REAL_BASELINE_BITS = (8, 6, 4)   # Part 2 on the real model: plain n-bit quantization rows


def compute_real(args):
    """SmolLM2: the measured codec (codec_real: step search under a KL budget), the baselines and the
    recipe at the same size, all on the evaluation prose. Cached in code/checkpoints/ like the study it
    builds on (several minutes of forwards and codec fits); --refit measures again."""
    from common.gguf_llama import gguf_file
    path = gguf_file(args.gguf)
    ident = {**cr.study_ident(path), "measure": [REAL_ENTROPY_STEP, REAL_BASELINE_BITS, ZLIB_LEVEL,
                                                kv.RECIPE_GROUP_FACTOR, kv.MATCH_HALVINGS]}
    r = cs.cached_study("codec-smollm2-02", ident, lambda: measure_real(path, args.refit), args.refit, idle_threads)
    r["delta_ratio"] = {k: np.asarray(v) for k, v in r["delta_ratio"].items()}
    return r


def measure_real(path, refit: bool) -> dict:
    prose = cr.Prose(path)
    study = cr.real_codec_study(path, refit=refit, prose=prose)
    Xc, Xe = prose.Xc, prose.Xe
    L, C, T = Xe.shape[2], Xe.shape[4], Xe.shape[1]
    rms = kv.kv_rms(Xc)
    delta = study["delta"]
    target = study["calib_bits"]["delta" if delta else "raw"]   # the measured codec's bits on calibration KV
    base = kv.match_bytes(lambda b: kv.fit_codec(Xc, kv.recipe_steps(rms, b), True), Xc, target)
    rows = baseline_rows(Xc, Xe, prose.quality, bits=REAL_BASELINE_BITS)
    recipe = cr.measure(prose, kv.fit_codec(Xc, kv.recipe_steps(rms, base), True))
    rows["recipe (anchor+delta, finer shallow)"] = (recipe["bytes_per_token"], recipe)
    level0 = study["levels"][0]
    rows[f"measured ({'anchor+delta' if delta else 'no deltas'})"] = (level0["bytes_per_token"], level0)
    raw_spec = kv.fit_codec(Xc, rms * REAL_ENTROPY_STEP, False)
    return {"info": prose.info, "tokens": T, "n_eval": len(Xe), "n_calib": len(Xc), "L": L, "C": C,
            "delta_ratio": delta_variance_ratios(Xe, kv.CODEC_GROUP), "rows": rows, "rel_steps": study["rel_steps"],
            "delta": bool(delta), "calib_bits": study["calib_bits"], "levels": study["levels"],
            "entropy": grouping_entropy(kv.quantize(Xc, raw_spec), kv.quantize(Xe, raw_spec))}


def report_real(r):
    d, L = r["delta_ratio"], r["L"]
    print()
    say(f"{r['info']['name']} ({L} layers, {r['C'] // 64} KV heads x 64): {r['n_calib']} calibration and "
        f"{r['n_eval']} evaluation paragraphs of the project's own prose, {r['tokens']} context tokens each.")
    print()
    group = kv.layer_groups(L)
    thirds = [np.flatnonzero(group == i) for i in range(3)]
    rows = [[f"layers {g[0]}-{g[-1]} {KV_NAMES[k]}", f"{d['anchor'][g, k].mean():.2f}x",
             f"{d['anchor'][g, k].min():.2f}-{d['anchor'][g, k].max():.2f}x", f"{d['previous'][g, k].mean():.2f}x",
             f"{d['previous'][g, k].min():.2f}-{d['previous'][g, k].max():.2f}x", HANDOUT["delta_ratio"] if i == k == 0 else ""]
            for i, g in enumerate(thirds) for k in range(2)]
    print(table(["", "anchor: mean", "range", "previous: mean", "range", "CacheGen"], rows,
                "Part 1a (§3.2, real model). Variance of raw values over variance of deltas, by thirds of the layers\n"
                "(>1: deltas smaller)"))
    print()
    print_entropy(r["entropy"], f"Part 1c (§3.2, real model). Entropy at steps of {REAL_ENTROPY_STEP:g} x RMS, tables fitted "
                                f"on calibration prose")
    fp16_b = r["rows"]["FP16"][0]
    rows = [[n, f"{b:,.0f}", f"{fp16_b / b:.2f}x", f"{q['nll']:.4f}", f"{q['kl']:.4f}",
             f"{100 * q['agree']:.1f}%"] for n, (b, q) in r["rows"].items()]
    print()
    print(table(["codec", "bytes/token", "ratio to FP16", "NLL (nats/token)", "KL from FP16", "top-1 = FP16's"], rows,
                f"Part 2 (§3.4, real model). Continuations of {cr.REAL_CONTINUATION} tokens attending to the decoded "
                f"context KV\n(coded rows: bytes of {cr.REAL_CODED} contexts really coded, bit-exact round trip checked)"))
    say("Measured steps / RMS (shallow, middle, deep thirds; K / V): "
        + ", ".join(f"{k:.3g} / {v:.3g}" for k, v in r["rel_steps"])
        + f"; KL from FP16 kept below {cr.REAL_MAX_KL} nats/token on calibration prose; recipe sized to the same bytes.")
    measured = next(b for n, (b, _) in r["rows"].items() if n.startswith("measured"))
    print_headline(r["rows"]["8-bit"][0], fp16_b, measured, r["info"]["name"])
    print()
    print(table(["level (03 Part 2c)", "steps", "bytes/token", "bits/value", "KL from FP16", "top-1 = FP16's"],
                [[f"level {lv['level']}", f"{kv.LEVEL_FACTOR ** lv['level']:.3g}x", f"{lv['bytes_per_token']:,.0f}",
                  f"{lv['bits_per_value']:.2f}", f"{lv['kl']:.4f}", f"{100 * lv['agree']:.1f}%"] for lv in r["levels"]],
                "Quality levels (§4.2) of the measured codec on the real model (codec_real.real_codec_levels(), read by 03)"))


def to_json_real(r):
    out = {"model": r["info"]["name"], "delta_var_ratio": [{f"{KV_NAMES[k]}_{ref}": float(r["delta_ratio"][ref][l, k])
                                                            for ref in r["delta_ratio"] for k in range(2)} for l in range(r["L"])],
           "entropy_bits": r["entropy"], "fp16_bytes_per_token": r["rows"]["FP16"][0],
           "zlib_ratio": r["rows"]["FP16"][0] / r["rows"]["zlib on FP16"][0], "nll_fp16": r["rows"]["FP16"][1]["nll"],
           "levels": [{k: lv[k] for k in ("bytes_per_token", "bits_per_value", "kl", "agree")} for lv in r["levels"]]}
    for name, (b, q) in r["rows"].items():
        key = name.split(" ")[0].replace("-", "").lower()
        out[f"bytes_{key}"], out[f"nll_{key}"], out[f"kl_{key}"], out[f"top1_agree_{key}"] = b, q["nll"], q["kl"], q["agree"]
    return out


def parse(argv):
    p = Parser(__doc__)
    p.add_argument("--sensitivity-step", type=positive_float, default=SENSITIVITY_STEP,
                   help="Part 1b: coarse step, in units of a layer's RMS")
    p.add_argument("--refit", action="store_true", help="redo the codec's step search and tables (cached otherwise)")
    p.add_argument("--model", choices=["record", "smollm2"], default="record",
                   help="record: the record-world model (every part); smollm2: Parts 1a, 1c and 2 on SmolLM2-135M")
    p.add_argument("--gguf", metavar="PATH", help="with --model smollm2: another LLaMA GGUF file")
    return p.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    if args.model == "smollm2":  # its long forwards run on the idle cores (compute_real: idle_threads)
        from common.gguf_llama import smollm2_or_explain
        args.gguf = smollm2_or_explain(args.gguf)
        if args.gguf is None:
            return
        r = compute_real(args)
        report_real(r)
        write_json(args.json, to_json_real(r))
        return
    with single_thread():  # the record model's batches are tiny: one thread is faster, and cores may be shared
        r = compute(args)
    report(r, args)
    figures(r)
    write_json(args.json, to_json(r, args))


if __name__ == "__main__":
    main()
