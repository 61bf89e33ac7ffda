"""Measuring CacheGen's codec on a model (handout §3): the KV a model caches as arrays, the answers it
reads from decoded KV, the greedy search for the coarsest steps that keep them, and the record-world
model's codec study (its quality levels, read by 03_streaming.py), cached in code/checkpoints/.

The codec itself (quantization, tables, levels) is kvcache.py's, its arithmetic coder coder.py's and
coder_parallel.py's; they need only numpy, and this file drives a model (torch). codec/smollm2.py runs the
same study on a real LLaMA.

Accuracy of a codec = answer accuracy when the question's tokens attend to the decoded (lossy) context
KV instead of the exact one: model(question_tokens, cache=decoded context KV).

    python -m lecture27.codec.study      # from code/: fit (or load) the record-world codec and print its levels
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from lecture27 import blend_world as bw
from lecture27 import kvcache as kv
from lecture27 import record_trainer as rt
from common.checkpoints import cached_result
from common.llama import array_to_kv, kv_to_array, single_thread

MEASURE_TOL = 0.0          # the step search keeps calibration accuracy >= FP16's - this
STEP_NOTCH = 2.0           # the search coarsens one (layer, K/V) step by this factor at a time
STEP_START = 2.0 ** -5     # ... starting from steps of this x the RMS of that (layer, K/V)
STEP_MAX_NOTCHES = 8       # ... up to STEP_START x STEP_NOTCH^8 = 8 x RMS (where nothing is left)
CODEC_N_CALIB = 1000       # calibration documents: tables, anchor scales, the step search
CODEC_N_EVAL = 2000        # evaluation documents (another seed): the accuracy reported
CODEC_N_CODED = 200        # evaluation contexts really coded to bytes (bytes/token); the coder is exact,
                           # so accuracy is computed from quantize() on all CODEC_N_EVAL
CODEC_CALIB_SEED, CODEC_EVAL_SEED = 27_001, 27_002


def context_kv(model, contexts, batch: int = 1000) -> np.ndarray:
    """Prefill each context (N, T) from position 0 and return its exact KV (N, T, L, 2, C), float32."""
    with torch.no_grad():
        return np.concatenate([kv_to_array(model(torch.as_tensor(contexts[i:i + batch]), last=True)[1])
                               for i in range(0, len(contexts), batch)])


def answer_accuracy(model, X, questions, answers, slots=None, batch: int = 250) -> dict:
    """Question tokens (N, Tq) attend to context KV X (N, T, L, 2, C); the positions `slots` of the
    question tokens must predict answers (N, len(slots)) (default: the last position, answers (N,)).
    -> {"acc", "nll"}: mean over every answer."""
    n_kv = model.cfg.n_kv_heads
    slots = torch.tensor([-1] if slots is None else slots)
    correct, nll, n = 0, 0.0, 0
    with torch.no_grad():
        for i in range(0, len(answers), batch):
            logits, _ = model(torch.as_tensor(questions[i:i + batch]), cache=array_to_kv(X[i:i + batch], n_kv))
            out = logits[:, slots].float().flatten(0, 1)
            ans = torch.as_tensor(answers[i:i + batch]).reshape(-1)
            correct += int((out.argmax(-1) == ans).sum())
            nll += float(F.cross_entropy(out, ans, reduction="sum"))
            n += ans.numel()
    return {"acc": correct / n, "nll": nll / n}


# ------------------------------------------------------------------ the step search
def search_steps(evaluate, rms, target: float, start: float = STEP_START, notch: float = STEP_NOTCH,
                 max_notches: int = STEP_MAX_NOTCHES, progress=None):
    """Greedy search for the coarsest steps that keep the answers: steps = rms * start * notch^e.
    Each round tries coarsening each (layer, K/V) by one notch alone; a try whose accuracy drops below
    `target` freezes that entry (as does reaching max_notches). Of the tries that pass, all are taken
    together if that passes too, else only the one that hurts the answers least (lowest NLL): every
    notch saves about one bit per value, so the least harmful is the best buy.
    evaluate(steps) -> {"acc", "nll"}. Returns (steps, trace of accepted moves)."""
    rms = np.asarray(rms, np.float64)
    e = np.zeros(rms.shape, int)
    frozen = np.zeros(rms.shape, bool)
    trace = []
    while not (frozen := frozen | (e >= max_notches)).all():
        passing = []
        for lk in zip(*np.nonzero(~frozen)):
            e2 = e.copy()
            e2[lk] += 1
            r = evaluate(rms * start * notch ** e2)
            if progress is not None:
                progress.update(1)
            if r["acc"] >= target:
                passing.append((r["nll"], lk, r))
            else:
                frozen[lk] = True
        if not passing:
            break
        passing.sort(key=lambda p: p[0])
        e_all = e.copy()
        for _, lk, _ in passing:
            e_all[lk] += 1
        r_all = evaluate(rms * start * notch ** e_all) if len(passing) > 1 else passing[0][2]
        if r_all["acc"] >= target:
            e, r, moved = e_all, r_all, [lk for _, lk, _ in passing]
        else:
            e[passing[0][1]] += 1
            r, moved = passing[0][2], [passing[0][1]]
        trace.append({"moved": [[int(a), int(b)] for a, b in moved], "acc": r["acc"], "nll": r["nll"]})
    return rms * start * notch ** e, trace


def cached_study(name: str, ident: dict, compute, refit: bool = False, threads=single_thread) -> dict:
    """compute() run under `threads` (one thread by default: the small models' batches are tiny, and the
    machine may be shared; idle_threads for a real model's long forwards), its JSON-able result cached in
    code/checkpoints/ under `ident` (computed again when it changes)."""
    def run():
        with threads():
            return compute()

    return cached_result(name, ident, run, refit, tag="codec")


# ------------------------------------------------------------------ the record-world model's codec
def codec_study(model, calib, evalset, progress: bool = True) -> dict:
    """Fit and measure the record model's codecs. calib / evalset: (contexts (N, T), questions (N, Tq),
    answers (N, Q) [, slots (Q,): the question positions that predict them]) from different seeds.
    Returns JSON-able results: the measured steps and their search, the chosen mode (deltas or not),
    every level's spec, bytes/token and accuracy, the recipe's steps."""
    from tqdm import tqdm
    Xc, Xe = context_kv(model, calib[0]), context_kv(model, evalset[0])
    T = Xe.shape[1]
    fp16_c = answer_accuracy(model, Xc.astype(np.float16).astype(np.float32), *calib[1:])
    fp16_e = answer_accuracy(model, Xe.astype(np.float16).astype(np.float32), *evalset[1:])
    rms = kv.kv_rms(Xc)
    L, C = Xc.shape[2], Xc.shape[4]
    bar = tqdm(desc="codec: step search", disable=not progress, leave=False)

    def evaluate(steps):  # raw quantization at these steps, answers on calibration documents
        spec = kv.CodecSpec(steps=np.asarray(steps, np.float32), delta=False,
                            anchor_scale=np.ones((L, 2, C), np.float32),
                            radius=np.full((L, 2), kv.CODEC_MAX_RADIUS))
        return answer_accuracy(model, kv.dequantize(kv.quantize(Xc, spec), spec), *calib[1:])

    steps, trace = search_steps(evaluate, rms, fp16_c["acc"] - MEASURE_TOL, progress=bar)
    bar.close()
    specs_fit, bits, other = kv.level_specs(Xc, steps)
    delta = specs_fit[0].delta

    def measure(spec):
        acc = answer_accuracy(model, kv.dequantize(kv.quantize(Xe, spec), spec), *evalset[1:])
        return {**kv.coded_size(spec, Xe[:CODEC_N_CODED]), "accuracy": acc["acc"], "nll": acc["nll"]}

    levels = [{"level": i, **measure(spec), "fp16_accuracy": fp16_e["acc"]}
              for i, spec in enumerate(tqdm(specs_fit, desc="codec: levels", disable=not progress, leave=False))]
    variants = {"delta" if delta else "raw": levels[0], "raw" if delta else "delta": measure(other)}
    # the recipe as published, at the size of level 0: deltas, 3 layer groups, finer steps in shallow layers
    base = kv.match_bytes(lambda b: kv.fitted_bits(Xc, kv.recipe_steps(rms, b), True), bits[delta])
    recipe = kv.fit_codec(Xc, kv.recipe_steps(rms, base), True)
    recipe_out = {**measure(recipe), "steps_over_rms": (recipe.steps / rms).tolist(), "spec": kv.spec_to_dict(recipe)}
    return {"acc_fp16_calib": fp16_c["acc"], "acc_fp16": fp16_e["acc"], "nll_fp16": fp16_e["nll"],
            "rms": rms.tolist(), "steps": steps.tolist(), "steps_over_rms": (steps / rms).tolist(),
            "search": trace, "delta": bool(delta), "calib_bits": {"delta": bits[True], "raw": bits[False]},
            "levels": levels, "specs": [kv.spec_to_dict(s) for s in specs_fit], "variants": variants,
            "recipe": recipe_out, "tokens_per_context": T, "n_calib": len(calib[2]), "n_eval": len(evalset[2])}


def record_world() -> dict:
    """The record-world model of blend_world.py and its documents, as the codec study uses them:
    {"model", "ident" (the checkpoint's identity), "docs": docs(n, seed) -> (contexts (n, 24),
    questions (n, 24): "? k" for all 12 records, answers (n, 12), slots: the 12 key positions)}."""
    model, meta = rt.record_model()
    slots = bw.answer_slots(bw.N_RECORDS).numpy()

    def docs(n, seed):
        rec = bw.sample_records(n, torch.Generator().manual_seed(seed))
        return rec.doc.numpy(), rec.question.numpy(), rec.answers.numpy(), slots

    return {"model": model.eval(), "ident": meta["ident"], "docs": docs}


def record_codec_study(refit: bool = False, progress: bool = True) -> dict:
    """codec_study() on the record-world model, cached in code/checkpoints/ under the model checkpoint's
    identity, the settings above and in kvcache.py that shape the study and the code that runs it
    (computed again when one changes, or with refit)."""
    world = record_world()
    ident = {
        "model": world["ident"], "group": kv.CODEC_GROUP, "anchor_bits": kv.ANCHOR_BITS,
        "max_radius": kv.CODEC_MAX_RADIUS, "search": [MEASURE_TOL, STEP_NOTCH, STEP_START, STEP_MAX_NOTCHES],
        "levels": [kv.LEVEL_FACTOR, kv.N_LEVELS], "recipe": [kv.RECIPE_GROUP_FACTOR, kv.MATCH_HALVINGS],
        "docs": [CODEC_N_CALIB, CODEC_N_EVAL, CODEC_N_CODED, CODEC_CALIB_SEED, CODEC_EVAL_SEED]}
    return cached_study("codec-record", ident, lambda: codec_study(
        world["model"], world["docs"](CODEC_N_CALIB, CODEC_CALIB_SEED), world["docs"](CODEC_N_EVAL, CODEC_EVAL_SEED),
        progress), refit)


def codec_levels(refit: bool = False) -> list[dict]:
    """The measured codec's quality levels on the record-world model, level 0 finest .. level 3 coarsest:
    [{"level", "bytes_per_token", "bits_per_value", "accuracy", "fp16_accuracy"}, ...] (cached)."""
    keys = ("level", "bytes_per_token", "bits_per_value", "accuracy", "fp16_accuracy")
    return [{k: lv[k] for k in keys} for lv in record_codec_study(refit)["levels"]]


def levels_text(title: str, levels: list, columns: list, source: str) -> str:
    """A codec's quality levels (§4.2) as a text table: one row per level's dict, a column per (header,
    format, key) of `columns` after the level."""
    from common.present import Field, render_text, table_of
    fields = [Field("level", get="level"), *(Field(header, fmt, get=key) for header, fmt, key in columns)]
    return render_text(table_of(title, "§4.2", fields, levels, source))


def main(argv=None):
    from common.cli import Parser
    p = Parser(__doc__)
    p.add_argument("--refit", action="store_true", help="redo the step search and the tables (cached otherwise)")
    a = p.parse_args(argv)
    study = record_codec_study(a.refit)
    title = (f"CacheGen-style codec on the record-world model: {'anchor+delta' if study['delta'] else 'no deltas'}; "
             f"level i = steps x {kv.LEVEL_FACTOR:.3g}^i")
    print(levels_text(title, study["levels"], [("bytes/token", "{:.1f}", "bytes_per_token"),
                                               ("bits/value", "{:.2f}", "bits_per_value"),
                                               ("accuracy", "{:.2%}", "accuracy"),
                                               ("FP16 accuracy", "{:.2%}", "fp16_accuracy")],
                      "codec.study.codec_study"))


if __name__ == "__main__":
    main()
