"""Your GPU against the time model (common/timemodel.py), which gives every GPU figure of 01, 03 and 04: on a
CUDA device, with random BF16 weights of the time model's own model shapes, time what those figures stand for
and print each beside the time model's figure for that GPU, with the ratio, and beside an NVIDIA H200's
measurement of the same thing (common/gpu_reference.json).

    python code/lecture27/gpu_check.py                  # on a CUDA device (about a minute on an H200)
    python code/lecture27/gpu_check.py --gpu H100       # the time model's GPU row (default: the device's own)
    python code/lecture27/gpu_check.py --json out.json  # + every row and the headline figures as JSON
    python code/lecture27/gpu_check.py --tiny           # the same code on small shapes on the CPU (a test)

Part 1 (§1.4): one large matmul, then a full prefill of LLaMA-3.1-8B at 1K-32K tokens (what recomputing costs).
Part 2 (§5.3): one layer of LLaMA-2-7B and of LLaMA-3.1-70B at 4K and 16K tokens: its full prefill against
        CacheBlend's 15% selective recompute (the selected tokens attend to the whole loaded cache, each only
        to keys at or before its own position), and the layer's KV copied from pinned CPU memory.
Part 3 (§1.4, §6): LLaMA-3.1-8B's KV of 12K tokens copied from pinned and from pageable CPU memory, at once and
        layer by layer.
Part 4: decode steps after 12K tokens, batch 1 and 16 (the layers only).
Part 5 (§5.4): every layer's KV loaded, then its 15% recomputed, one after the other, against the loads on a
        second CUDA stream while the previous layer recomputes.
Timed by CUDA events, each figure the median of RUNS runs after WARMUP warm-ups. Without a CUDA device it
says so and exits 2 (--tiny runs on the CPU, timed by perf_counter).
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace

import torch

from common import timemodel as tm
from common.cli import Parser, fail, fraction, nonneg_int, positive_int, settings, settings_from
from common.llama import single_thread
from common.present import Page
from lecture27.gpu import measure as gm
from lecture27.gpu import page as gp

K = 1024
MATMUL = 8192                             # Part 1: one MATMUL x MATMUL by MATMUL x MATMUL BF16 matmul
PREFILL_MODEL = "llama-3.1-8b"            # Part 1: the time model's anchor model
PREFILL_TOKENS = [1 * K, 4 * K, 12 * K, 32 * K]
LAYER_MODELS = ["llama-2-7b", "llama-3.1-70b"]   # Part 2: 04's two systems (multi-head and GQA)
LAYER_TOKENS = [4 * K, 16 * K]
RATIO = 0.15                              # CacheBlend's recompute ratio (Parts 2 and 5)
KV_MODEL, KV_TOKENS = "llama-3.1-8b", 12 * K      # Part 3: 1.6 GB of KV
DECODE_MODEL, DECODE_CONTEXT = "llama-3.1-8b", 12 * K   # Part 4
DECODE_BATCHES = [1, 16]
PIPELINE_MODEL = "llama-2-7b"             # Part 5: §5.4's example model
PIPELINE_TOKENS = [4 * K, 16 * K]
WARMUP, RUNS = 3, 10                      # untimed calls, then timed ones (the median is printed)
SEED = 0                                  # the random weights
# --tiny: every model becomes the time model's city LLaMA (4 layers, d 64, GQA) and every length these
TINY_MODEL = "city"
TINY_TOKENS = [32, 64]
TINY_BATCHES = [1, 4]
TINY_MATMUL = 64


@settings(globals())
class Settings:
    """One run's settings: the constants above (field = constant's name), as the command line set them; the
    time model's GPU row and --tiny."""
    gpu: str = "H200"
    tiny: bool = False


def tiny(s: Settings) -> Settings:
    """--tiny: the same run on small shapes (the CPU's)."""
    return replace(s, matmul=s.tiny_matmul, prefill_model=s.tiny_model, prefill_tokens=tuple(s.tiny_tokens),
                   layer_models=(s.tiny_model,), layer_tokens=tuple(s.tiny_tokens), kv_model=s.tiny_model,
                   kv_tokens=s.tiny_tokens[-1], decode_model=s.tiny_model, decode_context=s.tiny_tokens[-1],
                   decode_batches=tuple(s.tiny_batches), pipeline_model=s.tiny_model,
                   pipeline_tokens=tuple(s.tiny_tokens))


def parse(argv=None) -> tuple:
    """(this run's Settings, the parsed command line); bad input, and no CUDA device without --tiny, end the run
    in one line (exit 2)."""
    p = Parser(__doc__)
    p.add_argument("--gpu", choices=sorted(tm.GPUS), default=None,
                   help="the time model's GPU row to compare with (default: matched from the device's name; "
                        "with --tiny: H200)")
    p.add_argument("--tiny", action="store_true", help="small shapes on the CPU, timed by perf_counter (a test)")
    p.add_argument("--ratio", type=fraction, default=RATIO, help="CacheBlend's recompute ratio (Parts 2 and 5)")
    p.add_argument("--runs", type=positive_int, default=RUNS, help="timed runs per figure (the median is printed)")
    p.add_argument("--warmup", type=nonneg_int, default=WARMUP, help="untimed runs before them")
    a = p.parse_args(argv)
    if a.ratio == 0:
        p.error("argument --ratio: must be above 0 (a recompute of no token)")
    if not a.tiny and not torch.cuda.is_available():
        fail("no CUDA device here (torch.cuda.is_available() is False): this check times a GPU; --tiny runs the "
             "same code on small shapes on the CPU")
    gpu = a.gpu or ("H200" if a.tiny else gm.gpu_row(torch.cuda.get_device_name()))
    if gpu is None:
        fail(f"no row of the time model's GPUs matches {torch.cuda.get_device_name()!r}: name the closest with "
             f"--gpu ({', '.join(sorted(tm.GPUS))})")
    s = settings_from(Settings, a, globals(), gpu=gpu)
    return (tiny(s) if s.tiny else s), a


def main(argv=None) -> Page:
    s, a = parse(argv)
    dev = gm.Device(cuda=not s.tiny, seed=s.seed)
    page = Page("gpu_check", "Your GPU against the time model" + (" (--tiny: small shapes on the CPU)" if s.tiny
                                                                  else ""), "§1.4, §5.3-5.4", s, plot=not a.no_plot)
    with single_thread() if s.tiny else nullcontext():   # shapes too small for a second CPU thread
        res = gm.check(gm.Run(dev, s.gpu, s.warmup, s.runs), matmul_n=s.matmul, prefill_model=s.prefill_model,
                       prefill_tokens=s.prefill_tokens, layer_models=s.layer_models, layer_tokens=s.layer_tokens,
                       ratio=s.ratio, kv_model=s.kv_model, kv_tokens=s.kv_tokens, decode_model=s.decode_model,
                       decode_context=s.decode_context, decode_batches=s.decode_batches,
                       pipeline_model=s.pipeline_model, pipeline_tokens=s.pipeline_tokens)
    gp.show(page, res, s)
    page.finish(a.json)
    return page


if __name__ == "__main__":
    main()
