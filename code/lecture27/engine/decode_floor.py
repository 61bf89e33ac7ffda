"""A decode step against its floor (§1.4: decoding is bound by memory). To make one token a step reads every weight
once, SmolLM2's 538 MB in float32 with its head, so no step is faster than those bytes arrive from memory
(weights_read_seconds). decode_profile times the engine's own step (runner.run on the packed weights, the greedy pick
from each row's logits) of 1, 4 or 8 requests, each behind a cache of 200 tokens, and sets it beside that floor and
beside its matrix products alone (common.llama.product_seconds, serving/floor.py's floor under a prefill):

    python -m lecture27.engine.decode_floor        # from code/: the table (about 30 s)
"""
from __future__ import annotations

import time

import torch

from common.llama import product_seconds
from lecture27.engine import runner
from lecture27.engine.blocks import SeqCache

REPEATS = 3   # timings of the floor: the least is kept (the core undisturbed)


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
    weights once: python -m lecture27.engine.decode_floor (from code/)."""
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
        source="engine.decode_floor.decode_profile",
        notes=["The products: every linear layer's and the head's, for these rows, timed alone (product_seconds); "
               "the rest: the attention over each request's cache, the norms, RoPE, the cache's writes and Python. "
               "A step cannot take less than the floor: making a token reads every weight once."])))


if __name__ == "__main__":
    main()
