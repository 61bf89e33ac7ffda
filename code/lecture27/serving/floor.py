"""The arithmetic floor under chat8's two targets (§7): what no engine on this core can beat.

A prefill on a CPU is bound by arithmetic: its time goes to the matrix products x W^T of every linear layer, and
eight prompts are eight times one prompt's products, in whatever batch they run. So chat8's ratios have a floor
that scheduling cannot cross:
  last first token / lone TTFT   >=  P(the crowd's prompt tokens) / the lone request's TTFT
  crowd wall / serial wall       >=  (P(the crowd's prompt tokens) + (answer tokens - 1) P_decode) / serial wall
P(n) is the time this core takes for the products alone of n prompt rows through every layer (the seven linear
layers of each block) and the head's rows of the crowd's first tokens; P_decode the same for one row: after the last
user's first token its answer still needs one step per token, each reading every weight (the other users' decode
rows are left out, as if they cost nothing). Nothing else is in P: no attention, no norm, no Python, no HTTP. The
caller passes the model as the engine runs it (its weights packed: engine.runner.packed) and counts the crowd's
prompt tokens past the system message, which the store serves. The TTFT and the wall times are what the benchmark
measured, overheads and all, so the floor is the lowest ratio that an engine doing nothing but the products could
reach beside them.
"""
from __future__ import annotations

import time

import torch

REPEATS = 3   # timings of each product set: the least is kept (the core undisturbed)


@torch.no_grad()
def product_seconds(model, rows: int, head_rows: int, repeats: int = REPEATS) -> float:
    """The least of `repeats` timings of the matrix products of `rows` rows through every block's linear layers and
    of `head_rows` rows through the head (model: a common.llama.Llama, its weights packed or not), on this process's
    torch threads."""
    cfg = model.cfg
    g = torch.Generator().manual_seed(0)
    x, h = torch.randn(rows, cfg.d_model, generator=g), torch.randn(rows, cfg.d_ff, generator=g)
    a = torch.randn(rows, cfg.n_heads * cfg.head_dim, generator=g)

    def products():
        for blk in model.layers:
            blk.wq(x), blk.wk(x), blk.wv(x), blk.wo(a), blk.w_gate(x), blk.w_up(x), blk.w_down(h)
        model.logits(x[:head_rows])   # the head (and the final norm, a row's few hundred operations)

    products()   # the first call pays for the packing's first touch
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        products()
        best = min(best, time.perf_counter() - t0)
    return best


def chat8_floor(model, tokens: int, users: int, max_tokens: int, lone_ttft_s: float | None,
                serial_wall_s: float | None) -> dict:
    """{"tokens", "prefill_s", "decode_step_s", "last_over_lone", "wall_over_serial"}: the products of the crowd's
    `tokens` prompt tokens and of one decode row (module docstring), and the two ratios' floors against the measured
    times (None where a time is missing)."""
    prefill = product_seconds(model, tokens, users)
    step = product_seconds(model, 1, 1)
    wall = prefill + (max_tokens - 1) * step
    return {"tokens": tokens, "prefill_s": prefill, "decode_step_s": step,
            "last_over_lone": prefill / lone_ttft_s if lone_ttft_s else None,
            "wall_over_serial": wall / serial_wall_s if serial_wall_s else None}
