"""CacheGen's codec on a real LLaMA (SmolLM2-135M-Instruct): the set-up, the quality measure, and the
codec's step search and quality levels, cached. Used by 02 (--model smollm2) and 03 (Part 2c).

The record-world model answers from a 12-way arg-max with huge margins, so it tolerates about 1.8 bits
per value; a real LLaMA is far less tolerant. Its quality is measured on prose: the project's own
paragraphs (common/english.py), REAL_CONTEXT tokens of context whose KV is coded, then the tokens that
attend to the decoded KV (REAL_CALIB_CONTINUATION on calibration prose, REAL_CONTINUATION on evaluation).
Quality of a codec = mean KL(FP16 || codec) of the continuation's next-token distributions, and the
share of positions whose arg-max is FP16's; both with their noise, the standard error over the
evaluation paragraphs (positions within one paragraph are not independent), and for neighbouring levels
the paired difference (level_noise). The step search (codec/study.py's search_steps) keeps the KL below
REAL_MAX_KL on calibration paragraphs with one step per (third of the layers, K/V); level i multiplies
those steps by kvcache.LEVEL_FACTOR ** i.

    python -m lecture27.codec.smollm2      # from code/: fit (or load) and print the levels
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from lecture27.codec import study as cs
from lecture27 import kvcache as kv
from common.llama import idle_threads, kl_divergence
from common.llama import array_to_kv

REAL_CONTEXT = 100          # tokens of each paragraph whose KV is coded
REAL_CONTINUATION = 55      # evaluation: the next tokens, scored (every paragraph has at least 155 tokens)
REAL_CALIB_CONTINUATION = 15  # calibration: the step search scores this many (24 evaluations of the codec;
                              # 30 tokens find the same steps in 1.6x the time)
REAL_MAX_KL = 0.01          # the step search keeps the continuation's KL(FP16 || codec) below this (nats/token)
REAL_STEP_START = 2.0 ** -4  # ... starting from steps of this x each layer's RMS
REAL_CODED = 1              # evaluation contexts really coded to bytes (11,520 symbols per token: pure Python is
                            # slow; one context of 100 tokens is 1.15M values, its size within 0.5% of two's)

# {the searched steps (float64 bytes): fit()'s level specs}, made in this process: 03 fits the codec and then codes
# with it, and real_codec_specs takes these instead of computing them again
_fitted: dict = {}


def setup(gguf=None):
    """(model, info, (calibration contexts, continuations), (evaluation contexts, continuations)):
    SmolLM2 (or another LLaMA GGUF) and the project's prose, CALIBRATION paragraphs to fit the codec,
    EVALUATION paragraphs to measure it, each cut into REAL_CONTEXT tokens of context and a continuation
    (REAL_CALIB_CONTINUATION, REAL_CONTINUATION tokens)."""
    from common import english
    from common.gguf_llama import load_gguf_llama
    model, tok, info = load_gguf_llama(gguf)

    def split(paragraphs, n_cont):
        ids = [tok.encode(t).ids for t in paragraphs]
        ids = [i for i in ids if len(i) >= REAL_CONTEXT + n_cont]
        ctx = torch.tensor([i[:REAL_CONTEXT] for i in ids])
        cont = torch.tensor([i[REAL_CONTEXT:REAL_CONTEXT + n_cont] for i in ids])
        return ctx, cont

    return (model, info, split(english.CALIBRATION, REAL_CALIB_CONTINUATION),
            split(english.EVALUATION, REAL_CONTINUATION))


def continuation_quality(model, X, cont, ref=None) -> dict:
    """Continuation tokens attend to context KV X: mean NLL (nats/token) of cont[1:]; against `ref` (the
    same with FP16 KV): mean KL(ref || this) per token and the share of positions with ref's arg-max."""
    with torch.no_grad():
        logits, _ = model(cont, cache=array_to_kv(X, model.cfg.n_kv_heads))
    logp = logits[:, :-1].float().log_softmax(-1)
    out = {"nll": float(F.nll_loss(logp.flatten(0, 1), cont[:, 1:].flatten())), "logp": logp, "kl": 0.0, "agree": 1.0,
           "positions": cont[:, 1:].numel(), "kl_para": [0.0] * len(cont), "agree_para": [1.0] * len(cont)}
    if ref is not None:
        kl = kl_divergence(ref["logp"], logp)                              # (paragraphs, positions)
        agree = (logp.argmax(-1) == ref["logp"].argmax(-1)).float()
        out.update(kl=float(kl.mean()), agree=float(agree.mean()),
                   kl_para=kl.mean(1).tolist(), agree_para=agree.mean(1).tolist())
    return out


class Prose:
    """A model with its calibration and evaluation prose, the exact KV of both, and FP16 references."""

    def __init__(self, gguf=None):
        self.model, self.info, (cc, self.ccont), (ec, self.econt) = setup(gguf)
        self.Xc = cs.context_kv(self.model, cc.numpy(), batch=4)
        self.Xe = cs.context_kv(self.model, ec.numpy(), batch=4)
        self.ref_c = continuation_quality(self.model, self.Xc.astype(np.float16).astype(np.float32), self.ccont)
        self.ref_e = continuation_quality(self.model, self.Xe.astype(np.float16).astype(np.float32), self.econt)

    def quality(self, Xhat, on_calib: bool = False) -> dict:
        """{"nll", "kl", "agree"} of decoded context KV Xhat (calibration or evaluation prose)."""
        q = (continuation_quality(self.model, Xhat, self.ccont, self.ref_c) if on_calib
             else continuation_quality(self.model, Xhat, self.econt, self.ref_e))
        return {k: q[k] for k in ("nll", "kl", "agree", "positions", "kl_para", "agree_para")}


def fit(prose: Prose, progress: bool = True) -> dict:
    """The step search under the KL budget, deltas or not, and the N_LEVELS quality levels measured on
    the evaluation prose (bits per value really coded on REAL_CODED contexts, bit-exact round trip)."""
    from tqdm import tqdm
    Xc, Xe = prose.Xc, prose.Xe
    L, T, C = Xc.shape[2], Xe.shape[1], Xc.shape[4]
    rms = kv.kv_rms(Xc)
    third = kv.layer_groups(L)
    bar = tqdm(desc="smollm2: step search (layer thirds x K/V)", disable=not progress, leave=False)

    def evaluate(rel):  # rel (3, 2): steps / RMS for the shallow, middle, deep thirds, K and V
        spec = kv.CodecSpec(steps=(rms * np.asarray(rel)[third]).astype(np.float32), delta=False,
                            anchor_scale=np.ones((L, 2, C), np.float32), radius=np.full((L, 2), kv.CODEC_MAX_RADIUS))
        d = prose.quality(kv.dequantize(kv.quantize(Xc, spec), spec), on_calib=True)["kl"]
        return {"acc": -d, "nll": d}       # search_steps keeps "acc" >= target: here -KL

    rel, _ = cs.search_steps(evaluate, np.ones((3, 2)), -REAL_MAX_KL, start=REAL_STEP_START, progress=bar)
    bar.close()
    steps = rms * rel[third]
    specs, bits, _ = kv.level_specs(Xc, steps)
    _fitted[np.asarray(steps, np.float64).tobytes()] = specs
    levels = [{"level": i, **measure(prose, spec)} for i, spec in enumerate(specs)]
    return {"rel_steps": rel.tolist(), "steps": steps.tolist(), "delta": specs[0].delta,
            "calib_bits": {"delta": bits[True], "raw": bits[False]}, "levels": levels,
            "tokens_per_context": T, "values_per_token": L * 2 * C}


def measure(prose: Prose, spec) -> dict:
    """Bytes per token of REAL_CODED evaluation contexts really coded (round trip checked), and the
    quality of every evaluation context decoded at the spec's steps."""
    size = kv.coded_size(spec, prose.Xe[:REAL_CODED])
    assert size["roundtrip_exact"], "the arithmetic-coded bitstream did not decode bit for bit"  # a bug, never tuning
    return {**size, **prose.quality(kv.dequantize(kv.quantize(prose.Xe, spec), spec))}


def real_codec_study(gguf=None, refit: bool = False, progress: bool = True, prose: Prose | None = None) -> dict:
    """fit() on SmolLM2 (or the GGUF at `gguf`), cached in code/checkpoints/ under the file's name and
    size, every setting that shapes the search and the code that runs it (computed again when one changes)."""
    from common.gguf_llama import gguf_file
    path = gguf_file(gguf)
    return cs.cached_study("codec-smollm2", study_ident(path),
                           lambda: fit(prose if prose is not None else Prose(path), progress), refit, idle_threads)


def study_ident(path: Path) -> dict:
    """What the real-model study depends on: the model file, the codec's and the search's settings, the
    prose (its cache file is named by a hash of this)."""
    return {"gguf": [path.name, path.stat().st_size], "group": kv.CODEC_GROUP,
            "anchor_bits": kv.ANCHOR_BITS, "max_radius": kv.CODEC_MAX_RADIUS,
            "search": [REAL_MAX_KL, cs.STEP_NOTCH, REAL_STEP_START, cs.STEP_MAX_NOTCHES],
            "levels": [kv.LEVEL_FACTOR, kv.N_LEVELS],
            "prose": [REAL_CONTEXT, REAL_CALIB_CONTINUATION, REAL_CONTINUATION, REAL_CODED],
            "text": prose_digest()}


def prose_digest() -> str:
    """A short hash of the project's prose: the fitted codec is refitted when the prose changes."""
    import hashlib
    from common import english
    return hashlib.sha256("\n".join(english.CALIBRATION + english.EVALUATION).encode()).hexdigest()[:12]


def standard_error(xs) -> float:
    """Standard error of the mean of xs (one value per paragraph)."""
    xs = np.asarray(xs, dtype=float)
    return float(xs.std(ddof=1) / np.sqrt(len(xs))) if len(xs) > 1 else float("nan")


def level_noise(levels: list[dict]) -> list[dict]:
    """Per level: KL and top-1 agreement with their standard errors over paragraphs, and against the
    previous (finer) level the paired differences, each paragraph scored at both levels, with theirs."""
    out = []
    for i, lv in enumerate(levels):
        d = {"kl_se": standard_error(lv["kl_para"]), "agree_se": standard_error(lv["agree_para"])}
        if i:
            prev = levels[i - 1]
            dkl = np.subtract(lv["kl_para"], prev["kl_para"])
            dag = np.subtract(lv["agree_para"], prev["agree_para"])
            d |= {"kl_step": float(dkl.mean()), "kl_step_se": standard_error(dkl),
                  "agree_step": float(dag.mean()), "agree_step_se": standard_error(dag)}
        out.append(d)
    return out


def real_codec_levels(gguf=None) -> list[dict]:
    """The levels in 03_streaming's format: bits per value, and as "accuracy" the share of next-token
    arg-maxes equal to FP16's; also kl, the noise of both (level_noise) and the paragraphs scored."""
    levels = real_codec_study(gguf)["levels"]
    return [{"level": lv["level"], "bytes_per_token": lv["bytes_per_token"], "bits_per_value": lv["bits_per_value"],
             "accuracy": lv["agree"], "kl": lv["kl"], "positions": lv["positions"],
             "paragraphs": len(lv["kl_para"]), **noise}
            for lv, noise in zip(levels, level_noise(levels))]


def spec_tensors(spec: kv.CodecSpec) -> dict:
    """kvcache.spec_to_dict with its arrays as tensors, as the checkpoint folder stores them
    (kvcache.spec_from_dict reads it back)."""
    return {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in kv.spec_to_dict(spec).items()}


def real_codec_specs(gguf=None) -> list[kv.CodecSpec]:
    """The study's N_LEVELS codecs themselves, finest first, to code SmolLM2's KV for real (05's store,
    03's wire): fitted as fit() fits them (kvcache.level_specs on the calibration prose's KV at the searched
    steps), cached in the checkpoint folder beside the study."""
    from common.checkpoints import cached
    from common.gguf_llama import gguf_file
    path = gguf_file(gguf)

    def compute():
        steps = np.asarray(real_codec_study(path)["steps"], np.float64)
        specs = _fitted.get(steps.tobytes())   # fitted by this process's study: the same specs, from the same KV
        if specs is None:
            model, _, (calib, _), _ = setup(path)
            with idle_threads():
                Xc = cs.context_kv(model, calib.numpy(), batch=4)
            specs = kv.level_specs(Xc, steps)[0]
        return [spec_tensors(spec) for spec in specs]

    return cached("codec-smollm2-specs", study_ident(path), compute,
                  use=lambda d, entry: [kv.spec_from_dict(x) for x in d], tag="codec")


def main():
    from common.cli import Parser
    from common.gguf_llama import smollm2_or_explain
    p = Parser(__doc__)
    p.add_argument("--gguf", metavar="PATH", help="another LLaMA GGUF file")
    p.add_argument("--refit", action="store_true", help="redo the step search (cached otherwise)")
    a = p.parse_args()
    path = smollm2_or_explain(a.gguf)
    if path is None:
        return
    study = real_codec_study(path, a.refit)
    title = (f"CacheGen-style codec on {path.name}: steps / RMS by layer thirds (K / V) "
             + ", ".join(f"{k:.3g} / {v:.3g}" for k, v in study["rel_steps"])
             + f"; {'anchor+delta' if study['delta'] else 'no deltas'}; level i = steps x {kv.LEVEL_FACTOR:.3g}^i")
    print(cs.levels_text(title, study["levels"], [("bytes/token", "{:.0f}", "bytes_per_token"),
                                                  ("bits/value", "{:.2f}", "bits_per_value"),
                                                  ("KL from FP16", "{:.4f}", "kl"),
                                                  ("top-1 = FP16's", "{:.1%}", "agree")], "codec.smollm2.fit"))


if __name__ == "__main__":
    main()
