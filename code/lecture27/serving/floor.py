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

A decode step has a floor of another kind, memory's: engine/decode_floor.py.
"""
from __future__ import annotations

from common.llama import product_seconds   # the products of n rows, as the caller's model runs them


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

