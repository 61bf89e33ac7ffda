"""Benchmark an OpenAI-compatible server (handout §5.1, §6.3, §7) as its clients use it: time to first token, p50
and p99, wall time, tokens/s and errors, for a crowd of chat users at once, RAG documents retrieved in new orders,
the same documents in one message parted by a separator (rag1, as RAG code sends them), a long prompt sent again,
documents sent again and reordered, and a multi-turn chat.

    python code/lecture27/bench_serve.py                       # starts our engine with the store, then without
    python code/lecture27/bench_serve.py --url http://127.0.0.1:8000/v1 [--url no_store=http://...:8001/v1]
    python code/lecture27/bench_serve.py --peer vllm --peer llama.cpp   # + vLLM's and llama.cpp's servers
    python code/lecture27/bench_serve.py --client vllm --peer vllm      # vLLM's benchmark client, ours and vLLM's

Without --url it starts serve.py on a free port, one server after the other on this CPU: with the KV store
(prefixes reused exactly, messages reused in any order and blended), with --no-store, and for chat8 also with the
store and --max-running 1 (one request at a time: "serial"); each runs the same requests. --peer vllm and
--peer llama.cpp (repeatable; installed apart, by serving/install_peers.sh, never from requirements.txt) start
vLLM's CPU server on SmolLM2's weights in float32 with its prefix cache, and llama.cpp's llama-server on the GGUF
file with 4 slots and --cache-reuse, each with the same thread count as ours; for RAG each peer also answers every
request again with its cache out of the way, and the quality table sets each server's answers beside a full
prefill's. --blend-ratio R (repeatable) also starts ours with the store at CacheBlend's recompute ratio R, named
store@R, for rag alone: the quality table then sets each ratio's TTFT beside its answers, the trade-off the ratio
makes. --url NAME=URL names a server; the ratios block compares the ones named store, no_store and serial. The
workloads are serving/bench.py's: every timed request is sent the moment its user's answer before it ends, never
after a look at /health; only a workload's warm-up waits for the server to be idle, and the table says what each
warm-up sent. The tables put the servers side by side, figures/serve_bench.png draws TTFT p50 and p99; --json PATH
writes it all. Beside chat8's two ratios the targets table puts their floor (serving/floor.py): SmolLM2's matrix
products of the crowd's prompts alone, timed here after the servers have stopped, against the run's lone TTFT and
serial wall time (servers started here).
--client vllm drives the servers with vLLM's own benchmark client instead (`vllm bench serve`, from the vLLM venv
install_peers.sh makes; serving/vllm_client.py): its random dataset and a custom one of our rag1 prompts, against
ours with the store and every peer started (and every --url), one table of vLLM's own figures. --client ours
--client vllm runs both.
"""
from __future__ import annotations

import json
import secrets
import signal
import sys
from pathlib import Path

from common.cli import Parser, fraction, positive_int
from common.present import Page, Row, Table, cols
from lecture27.serving import bench, floor, launch, vllm_client
from lecture27.serving.bench_server import BenchServer, named

USERS = 4                   # concurrent users of rag and chat
CHAT8_USERS = 8             # chat8: users at once, one request each (after one alone)
RAG_REQUESTS = 8            # timed RAG requests (after one warm-up request per item)
RAG_ITEMS = 2               # built-in RAG items the requests draw their documents from (repeat takes the next
                            # item, reorder the one after it)
CHAT_TURNS = 3              # turns per chat user
MAX_TOKENS = 16             # answer tokens per request
KV_CHECKS = 2               # RAG requests sent once more asking our engine for the first token's KL
SEPARATOR = " # # "         # rag1: what parts the documents in one message (LMCache's blend_special_str, serve.py's)
THREADS = 1                 # threads of every server started here (ours and the peers): one, as 04 and 05 time
                            # theirs (a second thread that waits for a core the client holds slows every step)
WORKLOADS = ("chat8", "rag", "rag1", "repeat", "reorder", "chat")
CLIENTS = ("ours", "vllm")   # whose client sends the requests: serving/bench.py's workloads, or vLLM's benchmark
                            # client (serving/vllm_client.py)
CLIENT = ("ours",)          # the clients run when --client is not given
SERIAL = ("--max-running", "1")   # the flags of ours one request at a time, for chat8's wall time
RATIO = 0.15                # serve.py's CacheBlend recompute ratio, the one the server named store runs with
SPEC_NAMES = {"chat8": "concurrent"}   # a workload's name in --json's {server: {workload: figures}}, where it differs


def parse(argv=None):
    p = Parser(__doc__)
    p.add_argument("--url", type=named_url, action="append", default=[], metavar="[NAME=]URL",
                   help="a server's /v1 URL, repeatable; serial=URL runs chat8 only (default: start ours with and "
                        "without the store, and one request at a time for chat8)")
    p.add_argument("--model", default=None, help="the model name to ask for (default: the server's first)")
    p.add_argument("--api-key", default=None, help="Bearer token for the servers")
    p.add_argument("--workload", choices=[*WORKLOADS, "all"], action="append", default=[],
                   help="what to run (repeatable; default: all)")
    p.add_argument("--users", type=positive_int, default=USERS, help="concurrent users of rag and chat")
    p.add_argument("--chat8-users", type=positive_int, default=CHAT8_USERS, help="chat8: users at once")
    p.add_argument("--rag-requests", type=positive_int, default=RAG_REQUESTS, help="timed RAG requests")
    p.add_argument("--rag-items", type=positive_int, default=RAG_ITEMS, help="RAG items the documents come from")
    p.add_argument("--docs", type=positive_int, default=bench.RAG_DOCS, help="documents a RAG request carries")
    p.add_argument("--doc-words", type=positive_int, default=bench.DOC_WORDS, help="words a document")
    p.add_argument("--chat-turns", type=positive_int, default=CHAT_TURNS, help="turns per chat user")
    p.add_argument("--max-tokens", type=positive_int, default=MAX_TOKENS, help="answer tokens per request")
    p.add_argument("--threads", type=positive_int, default=THREADS,
                   help="threads of every server started here (ours and the peers)")
    p.add_argument("--peer", choices=launch.PEERS, action="append", default=[],
                   help="also start this peer's server and run it (repeatable)")
    p.add_argument("--blend-ratio", type=fraction, action="append", default=[], metavar="R",
                   help="also start ours with the store at CacheBlend's recompute ratio R (serve.py --ratio R, named "
                        "store@R) and run rag on it (repeatable): the quality table's TTFT beside its answers")
    p.add_argument("--client", choices=CLIENTS, action="append",
                   help="whose client drives the servers (repeatable): ours runs the workloads; vllm runs vLLM's "
                        "benchmark client (vllm bench serve, from the vLLM venv) with --vllm-dataset's datasets, "
                        "--rag-requests prompts each, --users at once, against ours with the store and the peers "
                        f"(default: {' '.join(CLIENT)})")
    p.add_argument("--vllm-dataset", choices=vllm_client.DATASETS, action="append",
                   help="--client vllm: vLLM's datasets to run (repeatable): random (random tokens), custom (our "
                        f"rag1 prompts) (default: {' '.join(vllm_client.DATASETS)})")
    p.add_argument("--random-input-len", type=positive_int, default=vllm_client.RANDOM_INPUT_LEN,
                   help="--client vllm: prompt tokens of a random-dataset request")
    a = p.parse_args(argv)
    if a.docs < 4:
        p.error("--docs: a RAG request carries at least 4 documents (two key passages, two distractors)")
    if a.rag_items > len(bench.RAG_ITEMS) - 2:
        p.error(f"--rag-items: at most {len(bench.RAG_ITEMS) - 2} (of the {len(bench.RAG_ITEMS)} built-in items, "
                "repeat and reorder each keep one)")
    if a.rag_requests > bench.rag_orders(a.rag_items, a.docs):
        p.error(f"--rag-requests: at most {bench.rag_orders(a.rag_items, a.docs)} (each item's {a.docs} documents "
                f"have {bench.rag_orders(1, a.docs)} orders besides their first)")
    if a.chat8_users >= len(bench.PROSE):
        p.error(f"--chat8-users: at most {len(bench.PROSE) - 1} (one passage a user, one for the lone request)")
    taken = {"users", "chat8_users", "max_tokens", "runs", "reuses", "same_answer", "threads", "rag_quality", "chat8",
             "reorder", "ratios", "chat8_floor", "vllm_client", "failed"}   # --json's other top-level keys
    for name, _ in a.url:
        if name in taken:
            p.error(f"--url {name}=...: {name!r} names one of --json's keys; call the server something else")
    if a.blend_ratio and a.url:
        p.error("--blend-ratio starts ours; with --url, start it yourself (serve.py --ratio R) and name it")
    a.peer = list(dict.fromkeys(a.peer))
    a.blend_ratio = list(dict.fromkeys(a.blend_ratio))
    a.clients = tuple(c for c in CLIENTS if c in (a.client or CLIENT))
    a.vllm_datasets = tuple(d for d in vllm_client.DATASETS if d in (a.vllm_dataset or vllm_client.DATASETS))
    for why in [launch.peer_missing(peer) for peer in a.peer] + \
            [vllm_client.missing(a.vllm_datasets) if "vllm" in a.clients else None]:
        if why:
            p.error(why)
    a.workloads = WORKLOADS if not a.workload or "all" in a.workload else \
        tuple(w for w in WORKLOADS if w in a.workload)
    return a


def named_url(text: str) -> tuple:
    """--url [NAME=]URL as (NAME, URL); NAME "" for a bare URL."""
    name, _, url = text.partition("=") if "=" in text.split("//")[0] else ("", "", text)
    return name, url


def servers(a) -> list:
    """[BenchServer], each with the workloads it runs: the URLs given, else ours with and without the store, when
    chat8 runs ours one request at a time, and for rag ours at each --blend-ratio (each started when its turn
    comes); then the peers, each on a free port of 127.0.0.1 with a.threads threads. Without our client, ours is
    started with the store alone (vLLM's client runs on no server started for our client's comparisons)."""
    def only(*workloads):
        return tuple(w for w in a.workloads if w in workloads)
    if a.url:
        out = [BenchServer(name or f"server{i + 1}", a.workloads, given_url=url, peer=name in launch.PEERS)
               for i, (name, url) in enumerate(a.url)]
    else:
        out = [BenchServer("store", a.workloads, launch.engine(threads=a.threads)),
               BenchServer("no_store", a.workloads, launch.engine("--no-store", threads=a.threads), only_ours=True),
               BenchServer("serial", only("chat8"), launch.engine(*SERIAL, threads=a.threads), only_ours=True)]
        out += [BenchServer("store", only("rag"), launch.engine("--ratio", f"{r:g}", threads=a.threads), ratio=r,
                            only_ours=True) for r in a.blend_ratio if r != RATIO]
    for peer in a.peer:
        if peer == "vllm":
            process = launch.vllm(launch.free_port(), a.threads)
        else:
            from common.gguf_llama import gguf_file
            process = launch.llama_server(gguf_file(None), launch.free_port(), a.threads)
        out.append(BenchServer(peer, a.workloads, process, peer=True))
    return [s for s in out if s.workloads and ("ours" in a.clients or not s.only_ours)]


def model_name(url: str, api_key: str | None) -> str:
    return bench.client_for(url, api_key).models.list().data[0].id


def run_one(a, server: BenchServer, model: str, tag: str) -> list:
    """The server's workloads, one after another: [Run]."""
    from tqdm import tqdm
    name, url, full = server.name, server.url, server.full_prefill
    common = dict(max_tokens=a.max_tokens, tag=tag, api_key=a.api_key)
    sized = dict(docs=a.docs, words=a.doc_words)

    def kv_checks():   # our engine, the store on, asked for the first token's KL
        return KV_CHECKS if server.role != "no_store" and bench.is_ours(url) else 0
    # a peer's rag: its timed requests, then each again with its cache out of the way (server.full_prefill)
    todo = {"chat8": (a.chat8_users + 1, lambda bar: bench.run_chat8(name, url, model, users=a.chat8_users,
                                                                    progress=bar.update, **common)),
            "rag": (a.rag_requests * (2 if full else 1), lambda bar: bench.run_rag(
                name, url, model, users=a.users, requests=a.rag_requests, items=a.rag_items, kv_checks=kv_checks(),
                reference=full and full[1], progress=bar.update, **common, **sized)),
            "rag1": (a.rag_requests, lambda bar: bench.run_rag(
                name, url, model, users=a.users, requests=a.rag_requests, items=a.rag_items, separator=SEPARATOR,
                kv_checks=kv_checks(), progress=bar.update, **common, **sized)),
            "repeat": (2, lambda bar: bench.run_repeat(name, url, model, item=a.rag_items, progress=bar.update,
                                                       **common, **sized)),
            "reorder": (3, lambda bar: bench.run_reorder(name, url, model, item=a.rag_items + 1,
                                                         progress=bar.update, **common, **sized)),
            "chat": (a.users * a.chat_turns, lambda bar: bench.run_chat(name, url, model, users=a.users,
                                                                        turns=a.chat_turns, progress=bar.update,
                                                                        **common))}
    runs = []
    for workload in server.workloads:
        n, run = todo[workload]
        with tqdm(total=n, desc=f"{name}: {workload}", leave=False) as bar:
            runs.append(run(bar))
    return runs


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


def show_quality(page: Page, runs: list, servers: list) -> None:
    rows = [Row([q["server"], q["reuses"], shown(q["ttft_p50_s"]), shown(q["from_store"], "{:.0%}"),
                 shown(q["same_answer"], "{:.0%}"), q["against"], shown(q["first_token_kl"], "{:.3f}")])
            for q in rag_quality(runs, servers)]
    if rows:
        page.table(Table(title="RAG, quality beside speed: each server's greedy answers against a full prefill of the "
                               "same prompt", section="§5.1",
                         cols=cols("server", "reuses", "TTFT p50", "from store", "same answer", "against", "KL"),
                         rows=rows, source="bench_serve.rag_quality",
                         notes=["Same answer: the share of the RAG answers equal, as text, to the full prefill's "
                                "answer to the same request. A peer's full prefill is its own, on the same server "
                                "and weights, sent one at a time after the timed requests; ours is no_store's (the "
                                "same engine with no store). vLLM reuses only exact prefixes, so what it reuses is "
                                "what a full prefill computes (the same numbers up to the batch they ran in); "
                                "llama.cpp shifts cached runs of tokens to their new place without recomputing them, "
                                "so each document's KV still attends only to what came before it when it was cached; "
                                f"ours recomputes {RATIO:.0%} of a blended document's tokens (store@R: R of them). "
                                "KL: the first answer token's KL to a full prefill (our engine's kv_check, on reused "
                                "documents); the peers do not say."]))


def shown(x, spec: str = "{:.2f}") -> str:
    return "-" if x is None else spec.format(x)


def from_store(s) -> float | None:
    """The share of a request's prompt tokens the server says it served from its cache (None: it does not say)."""
    return s.cached_tokens / s.prompt_tokens if s.prompt_tokens else None


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


def show(page: Page, runs: list, servers: list, a) -> None:
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


STEPS = {"repeat": ("a long prompt, first", "the same again"),
         "reorder": ("documents, first", "the same again", "the same, reordered")}


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
    rows = []
    for r in runs:
        if r.workload == "chat8":
            lone = r.alone.ttft_s if r.alone else None
            rows += [Row([r.server, "chat8", "one request alone", shown(lone), "1.00", shown(from_store(r.alone),
                                                                                             "{:.0%}"), "-"]),
                     Row([r.server, "chat8", f"the last first token of {r.users} at once (wall {r.wall_s:.1f} s)",
                          shown(r.last_first_token_s), shown(bench.over(r.last_first_token_s, lone)), "-", "-"])]
        elif r.workload in STEPS:
            first = r.samples[0].ttft_s
            rows += [Row([r.server, r.workload, step, shown(s.ttft_s), shown(bench.over(s.ttft_s, first)),
                          shown(from_store(s), "{:.0%}"), shown(s.kl, "{:.3f}")])
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


def chat8_floor(a, runs: list) -> dict | None:
    """serving/floor.py's floor under chat8's two ratios: SmolLM2's matrix products of the crowd's prompt tokens past
    the system message, as our engine runs them (packed weights, --threads threads), against the lone TTFT and the
    serial wall time of this run. None where store ran no chat8, or the servers are not ours started here."""
    crowd = next((r for r in runs if r.server == "store" and r.workload == "chat8"), None)
    if a.url or crowd is None:
        return None
    import torch
    from common.gguf_llama import load_gguf_llama
    from lecture27.engine import runner
    from lecture27.engine.chat import chat_prompt
    print("chat8's floor: timing SmolLM2's matrix products of the crowd's prompts on this core", flush=True)
    model, tok, _ = load_gguf_llama()
    torch.set_num_threads(a.threads)
    prompts = [chat_prompt(tok, [(m["role"], m["content"]) for m in bench.crowd_messages(u)])
               for u in range(a.chat8_users)]
    serial = next((r for r in runs if r.server == "serial" and r.workload == "chat8"), None)
    return floor.chat8_floor(runner.packed(model), sum(len(p) - len(p.system) for p in prompts), a.chat8_users,
                             a.max_tokens, crowd.alone and crowd.alone.ttft_s, serial and serial.wall_s)


FLOORS = {"chat8_last_over_lone": "last_over_lone", "chat8_wall_store_over_serial": "wall_over_serial"}


def show_ratios(page: Page, values: dict, failed: dict, floors: dict | None) -> None:
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


def run_vllm(a, name: str, url: str, model: str) -> list:
    """vLLM's benchmark client on one server, one dataset after another: [vllm_client.Result]."""
    out = []
    for dataset in a.vllm_datasets:
        print(f"{name}: vLLM's client, {dataset} dataset ({a.rag_requests} prompts, {a.users} at once)", flush=True)
        r = vllm_client.run(name, url, model, dataset, prompts=a.rag_requests, concurrency=a.users,
                            max_tokens=a.max_tokens, items=a.rag_items, docs=a.docs, words=a.doc_words,
                            input_len=a.random_input_len, api_key=a.api_key, separator=SEPARATOR)
        if r.error:
            print(f"{name}, {dataset}: {r.error}", flush=True)
        out.append(r)
    return out


def show_vllm(page: Page, results: list, a) -> None:
    rows = [Row([r.server, r.dataset, r.prompts, shown(r.completed, "{}"), shown(r.failed, "{}"),
                 shown(r.ttft_mean_s), shown(r.ttft_median_s), shown(r.ttft_p99_s), shown(r.tpot_median_s, "{:.3f}"),
                 shown(r.output_tokens_per_s, "{:.1f}"), shown(r.duration_s, "{:.1f}")]) for r in results]
    data = {"random": f"random token ids, {a.random_input_len} prompt tokens each",
            "custom": f"our rag1 prompts ({a.docs} documents of an item in a new order and the question, parted by "
                      f"{SEPARATOR!r}, in one user message)"}
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


def main(argv=None) -> list:
    """[bench.Run] of our client's workloads, then [vllm_client.Result] of vLLM's client."""
    a = parse(argv)
    page = Page("bench_serve", "an OpenAI-compatible server, benchmarked", "§5.1, §6.3, §7", plot=not a.no_plot)
    tag = f" (benchmark run {secrets.token_hex(3)})" if a.url else ""   # a server given has seen no prompt of ours
    print(f"threads: {a.threads} for every server started here (ours: --threads; vLLM: OMP_NUM_THREADS and "
          f"VLLM_CPU_OMP_THREADS_BIND; llama-server: --threads and --threads-batch)", flush=True)
    runs, vruns, failed, plan = [], [], {}, servers(a)
    for server in plan:
        try:
            try:
                if server.process is not None:
                    server.process.start()
                    print(f"{server.name}: {server.url} (pid {server.process.pid})", flush=True)
                model = a.model or model_name(server.url, a.api_key)
            except Exception as e:   # launch's RuntimeError, the client's errors: this server's, not the run's end
                failed[server.name] = f"{type(e).__name__}: {e}"
                print(f"{server.name}: did not run: {failed[server.name]}", flush=True)
                continue
            if "ours" in a.clients:
                runs += run_one(a, server, model, tag)
            if "vllm" in a.clients and not server.only_ours:
                vruns += run_vllm(a, server.name, server.url, model)
        finally:
            if server.process is not None:
                server.process.stop()
    if "ours" in a.clients:
        show(page, runs, plan, a)
        show_sequences(page, runs)
        show_quality(page, runs, plan)
    values = bench.ratios(runs)
    floors = chat8_floor(a, runs)
    if "ours" in a.clients:
        show_ratios(page, values, failed, floors)
    if "vllm" in a.clients:
        show_vllm(page, vruns, a)
        for name, why in failed.items():
            print(f"{name} did not run: {why}")
    if a.json:
        names = list(dict.fromkeys(r.server for r in runs))
        data = {"users": a.users, "chat8_users": a.chat8_users, "max_tokens": a.max_tokens,
                "runs": [{"server": r.server, "workload": r.workload, **r.summary()} for r in runs],
                **{name: {SPEC_NAMES.get(r.workload, r.workload): r.summary() for r in runs if r.server == name}
                   for name in names},
                "reuses": {name: named(plan, name).reuses() for name in names},
                "same_answer": {f"{s}/{w}": v for (s, w), v in bench.same_answers(runs).items()},
                "threads": {name: a.threads for name in names}, "rag_quality": rag_quality(runs, plan),
                **sequences(runs),
                "ratios": {key: {"value": values[key], "target": target,
                                 "met": None if target is None or values[key] is None else values[key] <= target,
                                 "floor": floors[FLOORS[key]] if floors and key in FLOORS else None}
                           for key, _, target in bench.CRITERIA},
                "chat8_floor": floors,
                "vllm_client": [r.summary() for r in vruns],
                "failed": failed}
        Path(a.json).write_text(json.dumps(data, indent=2) + "\n")
        print(f"wrote {a.json}")
    return runs + vruns


if __name__ == "__main__":
    # SIGTERM as Ctrl-C: the finally blocks stop every server started here, and subprocess.run vLLM's client
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    main()
