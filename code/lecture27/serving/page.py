"""How 05's Part "served" is shown: its table, notes, figure and --json keys (ServedRun.json()). The numbers are
served.py's measurement; every sentence here is chosen by them. Nothing here computes a lecture figure."""
from __future__ import annotations

import statistics

from common.present import Page, Row, Table, cols, pct0
from lecture27.serving.served import ServedRun, first_kl, parse_kv


def show_served(page: Page, r: ServedRun, s) -> None:
    page.part("Part 6", "§6-§7", "served: SmolLM2 behind the OpenAI API, the store behind it")
    st, no = r.store, r.no_store
    page.say(f"serve.py, started three times as a server of its own on 127.0.0.1, on one thread; the official openai "
             f"client streams every answer ({s.serve_max_tokens} tokens, temperature 0). RAG: {s.serve_docs} "
             f"documents of {s.serve_doc_words} words a request (a system message, each document a message, the "
             f"question last), {len(st.samples)} timed requests in new orders from {r.users} users at once, each "
             "user sending its next request the moment its answer ends. Before them one warm-up request per item "
             "puts its documents in the store in their first order, and the client waits until the engine is idle "
             "(its /health: nothing queued, nothing left to store); it waits again before the long prompt, whose "
             f"second time follows its first at once. rag1: the same requests with each one's documents and question "
             f"in one user message, {r.separator!r} between them (LMCache's blend_special_str: every engine cuts the "
             f"message there into chunks), after a warm-up of their own. chat8: one chat request alone, then "
             f"{r.crowd.users} users at once with one request each of its shape (bench_serve's chat8). reorder: "
             "documents never seen, the same again at once, then the same documents with every one moved, at once "
             f"(bench_serve's reorder; kv_check on the last). Redis: {r.redis_note}.")
    rows = [Row([name, run.workload, len(run.samples), run.errors, run.p(0.5), run.p(0.99), pct0(run.cached_share),
                 first_kl(run)])
            for name, run in (("A, the store", st), ("C, no store", no), ("A, the store", r.separated),
                              ("C, no store", r.separated_no_store))]
    rows += [Row([name, "one prompt", 1, int(x.error is not None), x.ttft_s, x.ttft_s, from_store(x), None])
             for name, x in (("A, a long prompt, first", r.first), ("A, the same again", r.again),
                             ("C, the same, no store", r.plain), ("B, a new engine on A's Redis", r.second))]
    crowd = r.crowd
    rows.append(Row([f"A, {crowd.users} users at once", crowd.workload, len(crowd.samples), crowd.errors, crowd.p(0.5),
                     crowd.p(0.99), pct0(crowd.cached_share), None]))
    rows += [Row([name, "reorder", 1, int(x.error is not None), x.ttft_s, x.ttft_s, from_store(x), x.kl])
             for name, x in zip(("A, documents never seen", "A, the same again", "A, the same reordered"),
                                r.reorder.samples)]
    page.table(Table(title="time to the first streamed token, seconds, as the client measures it", section="§6-§7",
                     cols=cols("engine", "what", ("requests", "{:,}"), ("errors", "{:,}"), ("TTFT p50", "{:.2f}"),
                               ("TTFT p99", "{:.2f}"), "from store", ("first-token KL", "{:.3f}")),
                     rows=rows, source="serving.served.measure_served", notes=notes(r), json=r.json()))
    figure(page, r)


def from_store(x) -> str:
    """The share of a request's prompt tokens whose KV came from the store (its x-kv-cache header), as text."""
    kv = parse_kv(x.kv)
    return pct0((kv["prefix"] + kv["blended"]) / (kv["prefix"] + kv["blended"] + kv["recomputed"])) if kv else "-"


def notes(r: ServedRun) -> list:
    st, no = r.store, r.no_store
    out = []
    if st.p(0.5) and no.p(0.5):
        out.append(f"RAG: with the store the median first token comes after {st.p(0.5):.2f} s, "
                   f"{st.p(0.5) / no.p(0.5):.2f}x the {no.p(0.5):.2f} s of a full prefill (p99 {st.p(0.99):.2f} s "
                   f"against {no.p(0.99):.2f} s); {pct0(st.cached_share)} of the prompt tokens came from the store, "
                   "the documents as chunks stored alone, shifted to their places and blended (CacheBlend)"
                   + (f", the first token's KL to a full prefill {st.kls[0]:.3f} nats (kv_check)." if st.kls else "."))
    one, one_no = r.separated, r.separated_no_store
    if one.p(0.5) and one_no.p(0.5):
        text = (f"rag1, the documents in one message at {r.separator!r}: the median first token comes after "
                f"{one.p(0.5):.2f} s with the store, {one.p(0.5) / one_no.p(0.5):.2f}x the {one_no.p(0.5):.2f} s "
                f"without it; {pct0(one.cached_share)} of the prompt tokens came from the store")
        kl, kl_messages = first_kl(one), first_kl(st)
        if kl is not None:
            text += f", the first token's KL to a full prefill {kl:.3f} nats"
            if kl_messages is not None:
                text += f" against {kl_messages:.3f} as messages"
                if kl > kl_messages:
                    text += (": inside one message no chat-template header parts the documents, so a document "
                             "prefilled alone is further from what it is in place (docs/engine.md, 'Documents in one "
                             "message')")
        out.append(text + ".")
    if r.first.ttft_s and r.again.ttft_s:
        prefix = (parse_kv(r.again.kv) or {}).get("prefix", 0)
        out.append(f"A repeated prompt, sent again the moment its answer ended: {r.again.ttft_s:.2f} s against "
                   f"{r.first.ttft_s:.2f} s the first time ({r.again.ttft_s / r.first.ttft_s:.2f}x): "
                   + (f"its exact prefix ({prefix:,} tokens) came from the store, and its answer " if prefix else
                      "the store served none of it (the first one's KV was not stored yet), so it was prefilled "
                      "again, and its answer ")
                   + ("is the one the engine without a store gives, token for token." if r.same_answer else
                      "differs from the engine without a store's" + (": float rounding of a prefill in two pieces "
                                                                      "moved a near tie." if prefix else ".")))
    crowd, alone = r.crowd, r.crowd.alone
    if crowd.p(0.5) is not None:
        tokens = statistics.fmean(s.prompt_tokens for s in crowd.samples)
        out.append(f"{crowd.users} chat users at once (chat8: each one request of about {tokens:.0f} prompt tokens, "
                   "all sent together): the median first token after "
                   f"{crowd.p(0.5):.2f} s, the p99 after {crowd.p(0.99):.2f} s"
                   + (f", against {alone.ttft_s:.2f} s for a request of their shape sent alone just before"
                      if alone is not None and alone.ttft_s else "")
                   + f"; the last of their answers ended {crowd.wall_s:.2f} s after they were sent.")
    moved = r.reordered
    if r.reorder_ratio is not None and moved is not None:
        cold, warm = r.reorder.samples[0], r.reorder.samples[1]
        out.append(f"Documents reordered (reorder): another item's documents, never seen, gave their first token after "
                   f"{cold.ttft_s:.2f} s ({from_store(cold)} of the prompt from the store), the same again at once "
                   f"after {warm.ttft_s:.2f} s, and the same documents with every one moved, sent at once, after "
                   f"{moved.ttft_s:.2f} s: {r.reorder_ratio:.2f}x the first time, which stands for the full prefill "
                   "(the same documents and question, prefilled whole; bench_serve's reorder_over_first); "
                   f"{pct0(r.reorder_cached_share)} of its prompt tokens came from the store, the documents as chunks "
                   "shifted to their new places and blended"
                   + (f", the first token's KL to a full prefill {moved.kl:.3f} nats (kv_check)."
                      if moved.kl is not None else "."))
    share = r.second_hit_share
    if share is not None:
        out.append(f"Two engines, one store: engine B, a new process with empty RAM and disk, found {pct0(share)} of "
                   f"its context's KV in the Redis server engine A had written, and answered in "
                   f"{r.second.ttft_s:.2f} s.")
    out.append(f"Errors: {r.errors}." + (
        f" With {r.users} users at once a RAG request with the store waited {st.queue_s:.2f} s on average for the "
        "model before its prefill began (x-queue-seconds; the engine's /metrics keeps it apart, l27_queue_seconds), "
        "and that wait is in its TTFT." if st.queue_s is not None else ""))
    return out


def figure(page: Page, r: ServedRun) -> None:
    with page.figure("05_served.png", "SmolLM2 served on this CPU: time to the first token, as the client waits",
                     figsize=(7, 5)) as (fig, ax):
        if ax is None:
            return
        names = ["RAG, A with the store", "RAG, C without", "rag1 (one message), A", "rag1 (one message), C",
                 "a long prompt, first time (A)", "the same again (A)", "RAG, B on A's Redis",
                 f"{r.crowd.users} chat users at once (A)", "documents reordered (A)"]
        values = [(r.store.p(0.5), r.store.p(0.99)), (r.no_store.p(0.5), r.no_store.p(0.99)),
                  (r.separated.p(0.5), r.separated.p(0.99)),
                  (r.separated_no_store.p(0.5), r.separated_no_store.p(0.99)),
                  (r.first.ttft_s, r.first.ttft_s), (r.again.ttft_s, r.again.ttft_s),
                  (r.second.ttft_s, r.second.ttft_s), (r.crowd.p(0.5), r.crowd.p(0.99)),
                  ((r.reordered.ttft_s,) * 2 if r.reordered is not None else (None, None))]
        for i, (name, (p50, p99)) in enumerate(zip(names, values)):
            if p50 is None:
                continue
            ax.barh(i, p50, color=f"C{i}")
            ax.hlines(i, p50, p99, color="black", lw=1)
            ax.text(p99, i, f"  {p50:.2f} s" + (f" (p99 {p99:.2f})" if p99 != p50 else ""), va="center", fontsize=8)
        ax.set_yticks(range(len(names)), names)
        ax.invert_yaxis()
        ax.set_xlabel("seconds (bar: median; line: to p99)")
        ax.set_xlim(0, 1.35 * max(v for pair in values for v in pair if v is not None))
