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

A decode step has a floor of another kind (§1.4: decoding is bound by memory): to make one token the step reads every
weight once, SmolLM2's 538 MB in float32 with its head, so no step is faster than those bytes arrive
(weights_read_seconds). decode_profile sets a step of 1, 4 or 8 requests beside it and beside its products:

    python -m lecture27.serving.floor          # from code/: the decode table (about 30 s)
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


# ================================================================================ a decode step's floor (§1.4)
def weights_read_seconds(model, repeats: int = REPEATS) -> float:
    """The least of `repeats` timings of reading every weight of `model` once (each parameter summed, the head's
    too): a decode step's floor, since making one token must read them all, and no product of one row can go
    faster than its weights arrive from memory."""
    weights = [p.detach() for p in model.parameters()]
    best = float("inf")
    for _ in range(repeats + 1):   # the first touches the pages
        t0 = time.perf_counter()
        for w in weights:
            w.sum()
        best = min(best, time.perf_counter() - t0)
    return best


@torch.no_grad()
def decode_profile(model, rows: int, context: int = 200, steps: int = 7) -> dict:
    """A decode step of `rows` requests, each behind `context` tokens of cache: engine.runner.run on the model as the
    engine runs it (its packed copy) and the greedy pick from each row's logits, the median of `steps` timings;
    beside it the matrix products of its rows (product_seconds: every linear layer and the head), what is left (the
    attention over each cache, the norms, RoPE, the cache's writes, Python), and the floor, weights_read_seconds.
    {"rows", "step_s", "products_s", "rest_s", "floor_s", "over_floor", "products_over_floor"}."""
    from lecture27.engine import runner
    from lecture27.engine.blocks import SeqCache
    engine_model = runner.packed(model)
    prompt = [(7 * i) % model.cfg.vocab_size for i in range(context)]
    caches = [SeqCache.empty(model.cfg, context + 2) for _ in range(rows)]
    for c in caches:
        runner.run(engine_model, [runner.Item(prompt, c, True)])

    def step():
        for c in caches:
            c.n = context   # each step decodes the same position again
        return [int(lg.argmax()) for lg in runner.run(engine_model, [runner.Item([1], c, True) for c in caches])]
    step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    step_s, products = sorted(times)[len(times) // 2], product_seconds(engine_model, rows, rows)
    floor = weights_read_seconds(model)
    return {"rows": rows, "step_s": step_s, "products_s": products, "rest_s": step_s - products, "floor_s": floor,
            "over_floor": step_s / floor, "products_over_floor": products / floor}


def main(argv=None) -> None:
    """A decode step of 1, 4 and 8 requests on SmolLM2, its products and the rest, beside the time to read its
    weights once: python -m lecture27.serving.floor (from code/)."""
    from common.cli import Parser, positive_int
    from common.gguf_llama import load_gguf_llama
    from common.render import render_text
    from common.table import Row, Table, cols
    p = Parser(main.__doc__, json=False)
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads (each server of the bench: 1)")
    p.add_argument("--rows", type=positive_int, nargs="+", default=[1, 4, 8], help="requests decoding at once")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    model, _, _ = load_gguf_llama()
    rows = [decode_profile(model, n) for n in a.rows]
    ms = [("step", "step_s"), ("products", "products_s"), ("the rest", "rest_s"), ("floor", "floor_s")]
    print(render_text(Table(
        title=f"A decode step of SmolLM2 (engine.runner.run, packed weights, {a.threads} thread(s)), each request "
              "behind 200 tokens, ms; the floor: every weight read once", section="§1.4",
        cols=cols("requests", *[(f"{name} ms", "{:.1f}") for name, _ in ms], ("products / floor", "{:.2f}x"),
                  ("step / floor", "{:.2f}x")),
        rows=[Row([r["rows"], *[1000 * r[k] for _, k in ms], r["products_over_floor"], r["over_floor"]])
              for r in rows],
        source="serving.floor.decode_profile",
        notes=["The products: every linear layer's and the head's, for these rows, timed alone (product_seconds); "
               "the rest: the attention over each request's cache, the norms, RoPE, the cache's writes and Python. "
               "A step cannot take less than the floor: making a token reads every weight once."])))


if __name__ == "__main__":
    main()
