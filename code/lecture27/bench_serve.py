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
from pathlib import Path

from common.cli import Parser, fraction, positive_int
from common.present import Page
from common.redis_server import exit_on_sigterm
from lecture27.serving import bench, floor, launch, serde, vllm_client
from lecture27.serving import page as sp
from lecture27.serving.bench_server import BenchServer

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


def parser() -> Parser:
    p = Parser(__doc__)
    p.add_argument("--url", type=named_url, action="append", default=[], metavar="[NAME=]URL",
                   help="a server's /v1 URL, repeatable; serial=URL runs chat8 only (default: start ours with and "
                        "without the store, and one request at a time for chat8)")
    p.add_argument("--model", default=None, help="the model name to ask for (default: the server's first)")
    p.add_argument("--api-key", default=None, help="Bearer token for the servers")
    p.add_argument("--workload", choices=[*WORKLOADS, "serde", "all"], action="append", default=[],
                   help="what to run (repeatable; default: all; serde, when named: serving/serde.py's servers)")
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
    return p


def parse(argv=None):
    """The command line, checked (bad input: one line, exit 2); a.clients, a.vllm_datasets and a.workloads in their
    lists' order, each --peer and --blend-ratio once."""
    p = parser()
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
    for name in (name for name, _ in a.url if name in sp.JSON_KEYS):
        p.error(f"--url {name}=...: {name!r} names one of --json's keys; call the server something else")
    if a.blend_ratio and a.url:
        p.error("--blend-ratio starts ours; with --url, start it yourself (serve.py --ratio R) and name it")
    a.peer, a.blend_ratio = list(dict.fromkeys(a.peer)), list(dict.fromkeys(a.blend_ratio))
    a.clients = tuple(c for c in CLIENTS if c in (a.client or CLIENT))
    a.vllm_datasets = tuple(d for d in vllm_client.DATASETS if d in (a.vllm_dataset or vllm_client.DATASETS))
    for why in [*map(launch.peer_missing, a.peer), "vllm" in a.clients and vllm_client.missing(a.vllm_datasets)]:
        if why:
            p.error(why)
    a.workloads = tuple(w for w in WORKLOADS if not a.workload or {"all", w} & set(a.workload))
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
    if a.url:
        out = [BenchServer(name or f"server{i + 1}", a.workloads, given_url=url, peer=name in launch.PEERS)
               for i, (name, url) in enumerate(a.url)]
    else:
        chat8, rag = (tuple(w for w in a.workloads if w == only) for only in ("chat8", "rag"))
        out = [BenchServer("store", a.workloads, launch.engine(threads=a.threads)),
               BenchServer("no_store", a.workloads, launch.engine("--no-store", threads=a.threads), only_ours=True),
               BenchServer("serial", chat8, launch.engine(*SERIAL, threads=a.threads), only_ours=True)]
        out += [BenchServer("store", rag, launch.engine("--ratio", f"{r:g}", threads=a.threads), ratio=r,
                            only_ours=True) for r in a.blend_ratio if r != RATIO]
    out += [BenchServer(peer, a.workloads, launch.peer(peer, a.threads), peer=True) for peer in a.peer]
    return [s for s in out if s.workloads and ("ours" in a.clients or not s.only_ours)]


def run_one(a, server: BenchServer, model: str, tag: str) -> list:
    """The server's workloads, one after another: [Run]. A peer's rag sends each timed request again with its cache
    out of the way (server.full_prefill); rag and rag1 ask our engine with the store for KV_CHECKS first-token KLs."""
    from tqdm import tqdm
    name, url, full = server.name, server.url, server.full_prefill

    def go(run, **kw):
        return lambda bar: run(name, url, model, max_tokens=a.max_tokens, tag=tag, api_key=a.api_key,
                               progress=bar.update, **kw)
    sized = dict(docs=a.docs, words=a.doc_words)
    rag = dict(users=a.users, requests=a.rag_requests, items=a.rag_items, **sized,
               kv_checks=KV_CHECKS if server.role != "no_store" and bench.is_ours(url) else 0)
    todo = {"chat8": (a.chat8_users + 1, go(bench.run_chat8, users=a.chat8_users)),
            "rag": (a.rag_requests * (2 if full else 1), go(bench.run_rag, reference=full and full[1], **rag)),
            "rag1": (a.rag_requests, go(bench.run_rag, separator=SEPARATOR, **rag)),
            "repeat": (2, go(bench.run_repeat, item=a.rag_items, **sized)),
            "reorder": (3, go(bench.run_reorder, item=a.rag_items + 1, **sized)),
            "chat": (a.users * a.chat_turns, go(bench.run_chat, users=a.users, turns=a.chat_turns))}
    runs = []
    for workload in server.workloads:
        n, run = todo[workload]
        with tqdm(total=n, desc=f"{name}: {workload}", leave=False) as bar:
            runs.append(run(bar))
    return runs


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


def main(argv=None) -> list:
    """[bench.Run] of our client's workloads, then [vllm_client.Result] of vLLM's client."""
    a = parse(argv)
    page = Page("bench_serve", "an OpenAI-compatible server, benchmarked", "§5.1, §6.3, §7", plot=not a.no_plot)
    tag = f" (benchmark run {secrets.token_hex(3)})" if a.url else ""   # a server given has seen no prompt of ours
    print(f"threads: {a.threads} for every server started here (ours: --threads; vLLM: OMP_NUM_THREADS and "
          f"VLLM_CPU_OMP_THREADS_BIND; llama-server: --threads and --threads-batch)", flush=True)
    runs, vruns, failed, plan = [], [], {}, servers(a)
    for server in plan:
        with server:   # a server started here is stopped when its turn ends, whatever ends it
            try:
                url = server.start()
                if server.process is not None:
                    print(f"{server.name}: {url} (pid {server.process.pid})", flush=True)
                model = a.model or bench.model_name(url, a.api_key)
            except Exception as e:   # launch's RuntimeError, the client's errors: this server's, not the run's end
                failed[server.name] = f"{type(e).__name__}: {e}"
                print(f"{server.name}: did not run: {failed[server.name]}", flush=True)
                continue
            if "ours" in a.clients:
                runs += run_one(a, server, model, tag)
            if "vllm" in a.clients and not server.only_ours:
                vruns += vllm_client.run_datasets(
                    server.name, server.url, model, a.vllm_datasets, prompts=a.rag_requests, concurrency=a.users,
                    max_tokens=a.max_tokens, items=a.rag_items, docs=a.docs, words=a.doc_words,
                    input_len=a.random_input_len, api_key=a.api_key, separator=SEPARATOR)
    serde_keys = serde.run_for(a)   # --workload serde, when named: its serve_serde* keys
    values, floors = bench.ratios(runs), chat8_floor(a, runs)
    if "ours" in a.clients and runs:
        sp.show_bench(page, runs, plan, a)
        sp.show_sequences(page, runs)
        sp.show_quality(page, runs, plan, RATIO)
        sp.show_ratios(page, values, failed, floors)
    if "vllm" in a.clients:
        sp.show_vllm(page, vruns, a, SEPARATOR)
        for name, why in failed.items():
            print(f"{name} did not run: {why}")
    if a.json:
        data = {**sp.bench_json(a, runs, vruns, plan, values, floors, failed), **(serde_keys or {})}
        Path(a.json).write_text(json.dumps(data, indent=2) + "\n")
        print(f"wrote {a.json}")
    return runs + vruns


if __name__ == "__main__":
    # SIGTERM as Ctrl-C: each server started here gets it at once (launch.py), then each with block stops its process
    # and subprocess.run vLLM's client
    exit_on_sigterm()
    main()
