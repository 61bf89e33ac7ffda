"""How 05's Part "served" and bench_serve.py's runs are shown: their tables, notes, figures and --json keys
(ServedRun.json(), bench_json). The numbers are served.py's and bench_serve's measurements (serving/bench.py,
vllm_client.py, floor.py); every sentence here is chosen by them. Nothing here computes a lecture figure."""
from __future__ import annotations

import statistics

from common.present import Page, Row, Table, cols, pct0
from lecture27.serving import bench, serde, vllm_client
from lecture27.serving.bench_server import named
from lecture27.serving.served import ServedRun, first_kl, parse_kv


# ================================================================================ 05's Part "served"
def show_served(page: Page, r: ServedRun, s) -> None:
    page.part("Part 6", "§6-§7", "served: SmolLM2 behind the OpenAI API, the store behind it")
    st, no = r.store, r.no_store
    page.say(f"serve.py, started three times as a server of its own on 127.0.0.1"
             f"{' (twice more for the last table)' if r.serde else ''}, on one thread; the official openai "
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
    if r.serde:
        show_serde(page, r)


def show_serde(page: Page, r: ServedRun) -> None:
    """Part 6's last table: the same RAG requests through D (FP16 records) and E (CacheGen's) on one Redis budget."""
    page.say(f"A compressed shared tier (§3-§4's bitstream in §6's tiers; LMCache's remote_serde): the same RAG "
             f"requests through engines D and E, each with a Redis server of its own of {r.serde_gb:g} GB as its only "
             "tier (no RAM or disk tier, a hot cache too small for a chunk: every reused document comes from Redis, "
             "as it must for a second engine). D keeps FP16 records there, E CacheGen's bitstream at the codec's "
             "level 0 (serve.py --serde cachegen); documents held: those a last request, in an order never sent, "
             "finds in Redis. Same as no_store: answers equal to C's, token for token.")
    page.table(serde.table(r.serde, r.no_store.samples, f"FP16 or CacheGen records in {r.serde_gb:g} GB of Redis",
                           serde.SHORT))


def from_store(x) -> str:
    """The share of a request's prompt tokens whose KV came from the store (its x-kv-cache header), as text."""
    kv = parse_kv(x.kv)
    return pct0((kv["prefix"] + kv["blended"]) / (kv["prefix"] + kv["blended"] + kv["recomputed"])) if kv else "-"


def rag_notes(r: ServedRun) -> list:
    """The notes on RAG with the store and without, its documents as messages and in one message (rag1)."""
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
    return out


def notes(r: ServedRun) -> list:
    st = r.store
    out = rag_notes(r)
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


# ================================================================================ bench_serve.py's tables
SPEC_NAMES = {"chat8": "concurrent"}   # a workload's name in --json's {server: {workload: figures}}, where it differs
JSON_KEYS = ("users", "chat8_users", "max_tokens", "runs", "reuses", "same_answer", "threads", "rag_quality", "chat8",
             "repeat", "reorder", "ratios", "chat8_floor", "vllm_client", "failed")   # bench_json's keys beside the
                                                                                       # servers' names
STEPS = {"repeat": ("a long prompt, first", "the same again"),   # each request of repeat and reorder, as sent
         "reorder": ("documents, first", "the same again", "the same, reordered")}
FLOORS = {"chat8_last_over_lone": "last_over_lone",   # a target's key -> its floor's in floor.chat8_floor's dict
          "chat8_wall_store_over_serial": "wall_over_serial"}


def show_bench(page: Page, runs: list, servers: list, a) -> None:
    """bench_serve's first table, every run of our client a row (`servers`: the BenchServers the runs name), and
    its figure of TTFT p50 and p99."""
    same = bench.same_answers(runs)
    rows = [Row([r.server, r.workload, r.users, r.requests, r.errors, shown(r.p(0.5)), shown(r.p(0.99)),
                 shown(r.queue_s), shown(r.wall_s, "{:.1f}"), shown(r.tokens_per_s, "{:.1f}"),
                 shown(r.cached_share, "{:.0%}"), shown(same.get((r.server, r.workload)), "{:.0%}"),
                 shown(r.summary().get("first_token_kl_mean"), "{:.3f}")]) for r in runs]
    page.table(Table(title=f"temperature 0, {a.max_tokens} answer tokens; each workload's warm-up, a wait for the "
                           "server to be idle, then every request sent the moment its user's answer before it ended "
                           "(TTFT in seconds, measured by this client to the first streamed text)",
                     section="§5.1, §6.3, §7",
                     cols=cols("server", "workload", "users", "requests", "errors", "TTFT p50", "TTFT p99", "queued",
                               "wall, s", "tokens/s", "from store", "same answer", "KL"),
                     rows=rows, source="serving.bench.at_once",
                     notes=table_notes(runs, servers)))
    with page.figure("serve_bench.png", "time to first token, p50 (bar) and p99 (line)", figsize=(8, 3.5)) as (fig, ax):
        if ax is not None:
            names = list(dict.fromkeys(r.server for r in runs))
            loads = list(dict.fromkeys(r.workload for r in runs))
            width = 0.8 / len(names)
            for i, name in enumerate(names):
                for j, w in enumerate(loads):
                    r = next((r for r in runs if r.server == name and r.workload == w), None)
                    if r is None or r.p(0.5) is None:
                        continue
                    x = j + (i - (len(names) - 1) / 2) * width
                    ax.bar(x, r.p(0.5), width * 0.9, color=f"C{i}", label=name if j == 0 else None)
                    ax.vlines(x, r.p(0.5), r.p(0.99), color="black", lw=1)
            ax.set_xticks(range(len(loads)), loads)
            ax.set_ylabel("seconds")
            ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))


def table_notes(runs: list, servers: list) -> list:
    """What each server reuses, what each workload's warm-up sent, and how every column is measured."""
    loads = dict.fromkeys(r.workload for r in runs)
    warm = "; ".join(f"{w}, {bench.WARMUP[w]}" for w in loads)
    crowd = ("; chat8 then sends one request alone, and its crowd the moment that answer ends (chat8's TTFT p50 "
             "and p99 are the crowd's)" if "chat8" in loads else "")
    reused = [f"{name}: reuses {named(servers, name).reuses()}." for name in dict.fromkeys(r.server for r in runs)]
    failures = [f"{r.server}, {r.workload}: {r.errors} of its requests failed; the first: {first}" for r in runs
                for first in [next((x.error for x in [r.alone, *r.samples] if x and x.error), None)] if first]
    return reused + failures + [
        f"Warm-up, what a workload sent before its timed requests: {warm}. Then the client waited until our server was "
        f"idle (its /health: nothing queued, nothing left to store){crowd}. No timed request waits for anything but "
        "its user's answer before it. TTFT p50 and p99: nearest rank (the ceil(q n)-th smallest). Wall: from the first "
        "timed request's start to the last answer's end; tokens/s: answer tokens over it. Queued: the mean time a "
        "request waited for the model inside its TTFT (x-queue-seconds; -: the server does not say). From store: the "
        "prompt tokens the server says it served from its cache (OpenAI's cached_tokens). Same answer: the answer's "
        "text equal to no_store's for the same request (greedy). KL: the first answer token's KL to a full prefill, "
        "measured by our engine (kv_check) on reused documents."]


def sequences(runs: list) -> dict:
    """{workload: {server: {figure: value}}}: chat8's lone request against its crowd, repeat's and reorder's
    requests one by one (what --json writes and the second table shows)."""
    out = {}
    for r in runs:
        t = [s.ttft_s for s in r.samples]
        if r.workload == "chat8":
            lone = r.alone.ttft_s if r.alone else None
            out.setdefault("chat8", {})[r.server] = {
                "users": r.users, "lone_ttft_s": lone, "last_first_token_s": r.last_first_token_s,
                "last_over_lone": bench.over(r.last_first_token_s, lone), "wall_s": r.wall_s}
        elif r.workload == "repeat" and len(t) == 2:
            out.setdefault("repeat", {})[r.server] = {
                "first_ttft_s": t[0], "again_ttft_s": t[1], "again_over_first": bench.over(t[1], t[0]),
                "same_answer": r.samples[0].text == r.samples[1].text}
        elif r.workload == "reorder" and len(t) == 3:
            out.setdefault("reorder", {})[r.server] = {
                "first_ttft_s": t[0], "again_ttft_s": t[1], "reordered_ttft_s": t[2],
                "reordered_over_first": bench.over(t[2], t[0]), "first_token_kl": r.samples[2].kl}
    return out


def show_sequences(page: Page, runs: list) -> None:
    """sequences' requests one by one, each against its workload's first."""
    rows = []
    for r in runs:
        if r.workload == "chat8":
            lone = r.alone.ttft_s if r.alone else None
            rows += [Row([r.server, "chat8", "one request alone", shown(lone), "1.00", shown(cached_share(r.alone),
                                                                                             "{:.0%}"), "-"]),
                     Row([r.server, "chat8", f"the last first token of {r.users} at once (wall {r.wall_s:.1f} s)",
                          shown(r.last_first_token_s), shown(bench.over(r.last_first_token_s, lone)), "-", "-"])]
        elif r.workload in STEPS:
            first = r.samples[0].ttft_s
            rows += [Row([r.server, r.workload, step, shown(s.ttft_s), shown(bench.over(s.ttft_s, first)),
                          shown(cached_share(s), "{:.0%}"), shown(s.kl, "{:.3f}")])
                     for step, s in zip(STEPS[r.workload], r.samples)]
    if rows:
        page.table(Table(title="one request against another: a request alone, then a crowd; a prompt sent again; "
                               "documents sent again and reordered, each the moment the answer before it ended",
                         section="§5, §6, §7",
                         cols=cols("server", "workload", "request", "TTFT, s", "x the first", "from store", "KL"),
                         rows=rows, source="serving.bench.one_after_another",
                         notes=["x the first: this TTFT over its workload's first (chat8: the lone request's). The "
                                "long prompt and the documents are RAG items no other workload sends; before the "
                                "first of them the client waited until the server was idle. KL: the reordered "
                                "answer's first token against a full prefill (our engine's kv_check)."]))


def rag_quality(runs: list, servers: list) -> list:
    """RAG's answers beside a full prefill's, one dict a server (`servers`: the BenchServers the runs name): what it
    reuses, its TTFT p50, the share of its answers equal to a full prefill's and which full prefill that is, the
    first token's KL (ours, kv_check)."""
    same, out = bench.same_answers(runs), []
    for r in runs:
        if r.workload != "rag" or r.server == "no_store":
            continue
        server = named(servers, r.server)
        if r.reference:
            share = bench.same_share(r.samples, r.reference)
            against = (server.full_prefill or ("the same server, its cache out of the way",))[0]
        elif any(x.server == "no_store" and x.workload == "rag" for x in runs):
            share, against = same.get((r.server, "rag")), "no_store's answer (our engine, every prompt prefilled)"
        else:
            share, against = None, "-"
        out.append({"server": r.server, "reuses": server.reuses(short=True), "ttft_p50_s": r.p(0.5),
                    "from_store": r.cached_share, "same_answer": share, "against": against,
                    "first_token_kl": r.summary().get("first_token_kl_mean")})
    return out


def show_quality(page: Page, runs: list, servers: list, ratio: float) -> None:
    """RAG's quality table (rag_quality); `ratio`: the recompute ratio of ours named store (serve.py's)."""
    rows = [Row([q["server"], q["reuses"], shown(q["ttft_p50_s"]), shown(q["from_store"], "{:.0%}"),
                 shown(q["same_answer"], "{:.0%}"), q["against"], shown(q["first_token_kl"], "{:.3f}")])
            for q in rag_quality(runs, servers)]
    if rows:
        page.table(Table(title="RAG, quality beside speed: each server's greedy answers against a full prefill of the "
                               "same prompt", section="§5.1",
                         cols=cols("server", "reuses", "TTFT p50", "from store", "same answer", "against", "KL"),
                         rows=rows, source="serving.page.rag_quality",
                         notes=["Same answer: the share of the RAG answers equal, as text, to the full prefill's "
                                "answer to the same request. A peer's full prefill is its own, on the same server "
                                "and weights, sent one at a time after the timed requests; ours is no_store's (the "
                                "same engine with no store). vLLM reuses only exact prefixes, so what it reuses is "
                                "what a full prefill computes (the same numbers up to the batch they ran in); "
                                "llama.cpp shifts cached runs of tokens to their new place without recomputing them, "
                                "so each document's KV still attends only to what came before it when it was cached; "
                                f"ours recomputes {ratio:.0%} of a blended document's tokens (store@R: R of them). "
                                "KL: the first answer token's KL to a full prefill (our engine's kv_check, on reused "
                                "documents); the peers do not say."]))


def show_ratios(page: Page, values: dict, failed: dict, floors: dict | None) -> None:
    """The engine's targets (bench.CRITERIA): each ratio measured, its target, and chat8's floors."""
    rows = [Row([what, shown(values[key], "{:.3f}" if target is None else "{:.2f}x"),
                 "-" if target is None else f"<= {target:g}x",
                 "-" if target is None or values[key] is None else ("yes" if values[key] <= target else "no"),
                 shown(floors[FLOORS[key]] if floors and key in FLOORS else None, "{:.2f}x")])
            for key, what, target in bench.CRITERIA]
    notes = ["-: a server or a workload that did not run (servers named store, no_store, serial)."]
    if floors:
        notes.append(f"floor: the lowest ratio an engine doing nothing but the matrix products could reach beside "
                     f"this run's lone TTFT and serial wall time (serving/floor.py): SmolLM2's products of the "
                     f"crowd's {floors['tokens']:,} prompt tokens past the system message took "
                     f"{floors['prefill_s']:.2f} s on this core, and of a decode step of one answer "
                     f"{1000 * floors['decode_step_s']:.0f} ms (the wall's floor: the prompts, then the last user's "
                     f"answer token by token). A target below its floor asks for less arithmetic, "
                     f"not better scheduling.")
    page.table(Table(title="the engine's targets", section="§7",
                     cols=cols("figure", "measured", "target", "met", "floor"), rows=rows,
                     source="serving.bench.ratios",
                     notes=notes + [f"{name} did not run: {why}" for name, why in failed.items()]))


def show_vllm(page: Page, results: list, a, separator: str) -> None:
    """vLLM's client's figures, a row per server and dataset (`separator`: what parts the custom prompts)."""
    rows = [Row([r.server, r.dataset, r.prompts, shown(r.completed, "{}"), shown(r.failed, "{}"),
                 shown(r.ttft_mean_s), shown(r.ttft_median_s), shown(r.ttft_p99_s), shown(r.tpot_median_s, "{:.3f}"),
                 shown(r.output_tokens_per_s, "{:.1f}"), shown(r.duration_s, "{:.1f}")]) for r in results]
    data = {"random": f"random token ids, {a.random_input_len} prompt tokens each",
            "custom": f"our rag1 prompts ({a.docs} documents of an item in a new order and the question, parted by "
                      f"{separator!r}, in one user message)"}
    page.table(Table(title=f"vLLM's benchmark client (vllm bench serve, backend {vllm_client.BACKEND}): "
                           f"{a.users} requests at once, temperature 0, ignore_eos, {a.max_tokens} answer tokens; "
                           "its own figures (TTFT in seconds)", section="§5.1, §7",
                     cols=cols("server", "dataset", "prompts", "completed", "failed", "TTFT mean", "TTFT median",
                               "TTFT p99", "TPOT median", "output tok/s", "duration, s"),
                     rows=rows, source="serving.vllm_client.run",
                     notes=[f"{d}: {data[d]}; warm-up (sent by our client, then a wait until our server is idle): "
                            f"{vllm_client.WARMUP[d]}." for d in dict.fromkeys(r.dataset for r in results)] +
                     ["Every figure is vLLM's client's, read from its --save-result JSON: TTFT to the first streamed "
                      "chunk, its median and p99 numpy's (interpolated between ranks, not the nearest rank of our "
                      "tables); TPOT: the time per answer token after the first; output tok/s: answer tokens over "
                      "the duration (the first request's start to the last answer's end). vLLM's client sends no "
                      "system message: each server puts its chat template's default one first."] +
                     [f"{r.server}, {r.dataset}: {r.error}" for r in results if r.error]))


def bench_json(a, runs: list, vruns: list, servers: list, values: dict, floors: dict | None, failed: dict) -> dict:
    """What bench_serve --json writes: the settings, every run's figures (by server and workload too: SPEC_NAMES),
    what each server reuses, sequences, the quality and the targets, chat8's floor, vLLM's client's results and the
    servers that did not run."""
    names = list(dict.fromkeys(r.server for r in runs))
    return {"users": a.users, "chat8_users": a.chat8_users, "max_tokens": a.max_tokens,
            "runs": [{"server": r.server, "workload": r.workload, **r.summary()} for r in runs],
            **{name: {SPEC_NAMES.get(r.workload, r.workload): r.summary() for r in runs if r.server == name}
               for name in names},
            "reuses": {name: named(servers, name).reuses() for name in names},
            "same_answer": {f"{s}/{w}": v for (s, w), v in bench.same_answers(runs).items()},
            "threads": {name: a.threads for name in names}, "rag_quality": rag_quality(runs, servers),
            **sequences(runs),
            "ratios": {key: {"value": values[key], "target": target,
                             "met": None if target is None or values[key] is None else values[key] <= target,
                             "floor": floors[FLOORS[key]] if floors and key in FLOORS else None}
                       for key, _, target in bench.CRITERIA},
            "chat8_floor": floors,
            "vllm_client": [r.summary() for r in vruns],
            "failed": failed}


def shown(x, spec: str = "{:.2f}") -> str:
    return "-" if x is None else spec.format(x)


def cached_share(s) -> float | None:
    """The share of a request's prompt tokens the server says it served from its cache (None: it does not say)."""
    return s.cached_tokens / s.prompt_tokens if s.prompt_tokens else None
