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
  codec/study.py    MEASURE_TOL and STEP_* (the step search), CODEC_N_CALIB / CODEC_N_EVAL / CODEC_N_CODED
                  (documents) and their seeds
  codec/smollm2.py  REAL_MAX_KL (the real model's quality budget), REAL_CONTEXT / REAL_CONTINUATION
The settings at the top of this file are the measurements' own. The measurements are codec/measures.py's;
how each Part is shown (tables, notes, figures, --json keys, the handout's figures) is codec/page.py's.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from lecture27.codec import measures as cm
from lecture27.codec import page as cp
from lecture27.codec import study as cs
from lecture27 import kvcache as kv
from common.measured import cached_measurement, fingerprint, measured_note
from common.cli import Parser, positive_float, settings, settings_from, shipped_defaults
from common.llama import single_thread
from common.present import Page

MODEL = "record"            # record: the record-world model; smollm2: a real LLaMA
GGUF = None                 # with smollm2: another LLaMA GGUF file (None: SmolLM2-135M-Instruct)
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


@settings(globals())
class Settings:
    """One run's inputs: the constants above, as the command line left them (field = constant's name)."""


TITLE = "CacheGen part one: compress KV like video"


# ------------------------------------------------------------------------------------- the record world
def observations(run: cm.RecordRun, s: Settings) -> cm.Observations:
    """Part 1 (§3.2): token locality, each layer's sensitivity at the run's coarse steps, and the entropy of
    the values at level ENTROPY_LEVEL's steps under each grouping of the tables."""
    study, steps = run.study, sorted({*s.sensitivity_steps, s.sensitivity_step})
    layers = cm.cached_sensitivity(run.model, run.Xe, run.ev, run.rms, steps, s.sensitivity_step)
    return cm.Observations(n_calib=study.n_calib, n_eval=study.n_eval, tokens=run.Xe.shape[1],
                           values_per_token=int(np.prod(run.Xe.shape[2:])),
                           locality=cm.delta_variance_ratios(run.Xe, kv.CODEC_GROUP),
                           sensitivity=cm.Sensitivity(steps, s.sensitivity_step, layers, study.acc_fp16,
                                                      study.steps_over_rms),
                           entropy=cm.entropy_at(run.Xc, run.Xe, study.specs[s.entropy_level].steps))


def codec_table(run: cm.RecordRun, s: Settings) -> cm.Codecs:
    """Part 2 (§3.4): FP16, zlib and n-bit codes measured here beside the study's recipe and measured codec."""
    baselines = cm.baseline_rows(run.Xc, run.Xe, cm.record_quality(run), s.baseline_bits, s.zlib_level)
    return cm.record_codecs(run, baselines)


def coder(run: cm.RecordRun, codecs: cm.Codecs) -> cm.CoderCheck:
    """Part 3 (§3.3): level 0's coder on one whole context and on CODEC_N_CODED contexts' bitstreams; with
    the levels 03 reads (§4.2)."""
    spec = run.study.specs[0]
    one, many = cm.coder_check(spec, run.Xe, cs.CODEC_N_CODED)
    return cm.CoderCheck(one, many, cm.stream_layout(spec, run.Xe.shape[1]), codecs)


def coders_timed(spec, q, s: Settings, unit: str, remeasure: bool) -> tuple:
    """Exercise 3's coders timed on the symbols of q at spec, measured once on this machine and cached
    (measured.cached_measurement): (cm.Throughput, when and where)."""
    return cached_measurement(f"coders-{s.model}", {"symbols": fingerprint((spec, q)), "streams": s.coder_streams},
                              lambda: cm.coder_throughput(spec, q, s.coder_streams, unit), remeasure, tag="02")


def exercise3(run: cm.RecordRun, s: Settings, remeasure: bool = False) -> tuple:
    """Exercise 3 (§3.3): groups decode alone, the error by position in a group; the coders side by side.
    (cm.Exercise3, when and where its coders were timed)."""
    spec = run.study.specs[0]
    q = kv.quantize(run.Xe[:cs.CODEC_N_CODED], spec)
    timed, when = coders_timed(spec, q, s, "context", remeasure)
    return cm.Exercise3(cm.independence(kv.fit_codec(run.Xc, spec.steps, True), run.Xe, s.ex3_contexts), timed), when


def exercise4(s: Settings) -> cm.Exercise4:
    """Exercise 4 (§3.3) on the run's distribution: entropy, the coder's bits per value, a fixed-length code."""
    return cm.exercise4(s.ex4_probs, s.ex4_samples)


# ------------------------------------------------------------------------------------- a real model
def real_model(gguf, s: Settings, refit: bool) -> cm.Real:
    """Parts 1 and 2 (§3.2, §3.4) on SmolLM2: locality, entropy, the codec table and the levels (cached)."""
    return cm.real_measures(gguf, refit, s.real_entropy_step, s.real_baseline_bits, s.zlib_level)


def real_coders(r: cm.Real, s: Settings, remeasure: bool = False) -> tuple:
    """Exercise 3 (§3.3) measured on the real model's level-0 symbols: (cm.RealCoders, when and where)."""
    timed, when = coders_timed(r.coded_spec, r.coded_q, s, "paragraph", remeasure)
    return cm.RealCoders(r.name, timed), when


# ------------------------------------------------------------------------------------- the run
def parse(argv) -> tuple:
    """(this run's Settings, the defaults' Settings for its model, the parsed command line)."""
    p = Parser(__doc__)
    p.add_argument("--sensitivity-step", type=positive_float, default=SENSITIVITY_STEP,
                   help="Part 1b: coarse step, in units of a layer's RMS")
    p.add_argument("--refit", action="store_true", help="redo the codec's step search and tables (cached otherwise)")
    p.add_argument("--remeasure", action="store_true",
                   help="exercise 3: time the coders again (a later run shows the times measured on this machine)")
    p.add_argument("--model", choices=["record", "smollm2"], default=MODEL,
                   help="record: the record-world model (every part); smollm2: Parts 1a, 1c, 2 and exercise 3's "
                        "coders on SmolLM2-135M")
    p.add_argument("--gguf", metavar="PATH", default=GGUF, help="with --model smollm2: another LLaMA GGUF file")
    a = p.parse_args(argv)
    defaults = dataclasses.replace(shipped_defaults(Settings, globals()), model=a.model)  # each model its own
    return settings_from(Settings, a, globals()), defaults, a


def main(argv=None):
    s, defaults, a = parse(argv)
    if s.model == "smollm2":  # its long forwards run on the idle cores (codec/measures.real_measures)
        from common.gguf_llama import smollm2_or_explain
        gguf = smollm2_or_explain(s.gguf)
        if gguf is None:
            return None
        page = Page("02_smollm2", TITLE + ", on a real LLaMA", "§3", s, defaults, plot=not a.no_plot)
        r = real_model(gguf, s, a.refit)
        cp.show_real_observations(page, r, s)               # Part 1, §3.2
        cp.show_real_codecs(page, r, s)                     # Part 2, §3.4 (and the levels, §4.2)
        coders, when = real_coders(r, s, a.remeasure)
        cp.show_real_exercise3(page, coders, s)             # exercise 3, §3.3
        page.say(measured_note(when))
        return page.finish(a.json)
    page = Page("02", TITLE, "§3", s, defaults, plot=not a.no_plot)
    with single_thread():  # the record model's batches are tiny: one thread is faster, and cores may be shared
        run = cm.record_run(a.refit)
        cp.show_observations(page, observations(run, s), s)   # Part 1, §3.2
        codecs = codec_table(run, s)
        cp.show_codec_table(page, codecs, s)                  # Part 2, §3.4
        cp.show_coder(page, coder(run, codecs), s)            # Part 3, §3.3 (and the levels, §4.2)
        ex3, when = exercise3(run, s, a.remeasure)
        cp.show_exercise3(page, ex3, s)                       # exercise 3, §3.3
        page.say(measured_note(when))
        cp.show_exercise4(page, exercise4(s), s)              # exercise 4, §3.3
    return page.finish(a.json)


if __name__ == "__main__":
    main()
