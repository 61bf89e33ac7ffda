"""Benchmark an OpenAI-compatible server (handout §5.1, §6.3, §7): time to first token, p50 and p99, total time,
tokens/s and errors, for a multi-turn chat and for RAG documents retrieved in new orders, with concurrent users.

    python code/lecture27/bench_serve.py                       # starts our engine with the store, then without
    python code/lecture27/bench_serve.py --url http://127.0.0.1:8000/v1 [--url no_store=http://...:8001/v1]
    python code/lecture27/bench_serve.py --peer llama.cpp      # + llama.cpp's server on the same GGUF file

Without --url it starts serve.py on a free port twice, one after the other on this CPU: with the KV store
(prefixes reused exactly, messages reused in any order and blended) and with --no-store; each runs the same
requests. --peer llama.cpp (needs llama-cpp-python, built from source by pip: not in requirements.txt) starts
llama.cpp's OpenAI server with its prompt cache, which reuses the longest common prefix of the prompt before.
The table puts them side by side, figures/serve_bench.png draws TTFT p50 and p99; --json PATH writes it all.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # code/ holds `common`

from common.cli import Parser, positive_int  # noqa: E402
from common.present import Page, Row, Table, cols  # noqa: E402
from lecture27.engine import bench, launch  # noqa: E402

USERS = 4                   # concurrent users
RAG_REQUESTS = 8            # timed RAG requests (after one warm-up request per item)
RAG_ITEMS = 2               # built-in RAG items the requests draw their documents from
CHAT_TURNS = 3              # turns per chat user
MAX_TOKENS = 16             # answer tokens per request
KV_CHECKS = 2               # RAG requests sent once more asking our engine for the first token's KL
THREADS = 1                 # threads of a server started here: one, as 04 and 05 time theirs (a second thread that
                            # waits for a core the client holds slows every step)
WORKLOADS = ("rag", "chat")
REUSES = {"store": "prefixes exactly; messages in any order, blended",
          "no_store": "nothing (every prompt prefilled)",
          "llama.cpp": "the longest common prefix of its last prompt (its prompt cache)"}


def parse(argv=None):
    p = Parser(__doc__)
    p.add_argument("--url", action="append", default=[], metavar="[NAME=]URL",
                   help="a server's /v1 URL, repeatable (default: start ours with and without the store)")
    p.add_argument("--model", default=None, help="the model name to ask for (default: the server's first)")
    p.add_argument("--api-key", default=None, help="Bearer token for the servers")
    p.add_argument("--workload", choices=[*WORKLOADS, "both"], default="both", help="what to run")
    p.add_argument("--users", type=positive_int, default=USERS, help="concurrent users")
    p.add_argument("--rag-requests", type=positive_int, default=RAG_REQUESTS, help="timed RAG requests")
    p.add_argument("--rag-items", type=positive_int, default=RAG_ITEMS, help="RAG items the documents come from")
    p.add_argument("--docs", type=positive_int, default=bench.DOCS, help="documents a RAG request carries")
    p.add_argument("--chat-turns", type=positive_int, default=CHAT_TURNS, help="turns per chat user")
    p.add_argument("--max-tokens", type=positive_int, default=MAX_TOKENS, help="answer tokens per request")
    p.add_argument("--threads", type=positive_int, default=THREADS, help="torch threads of a server started here")
    p.add_argument("--peer", choices=["llama.cpp"], default=None, help="also start llama.cpp's server and run it")
    a = p.parse_args(argv)
    if a.docs < 4:
        p.error("--docs: a RAG request carries at least 4 documents (two key passages, two distractors)")
    if a.peer and not launch.llama_cpp_installed():
        p.error("--peer llama.cpp: llama-cpp-python is not installed (pip install 'llama-cpp-python[server]', a "
                "build from source of about 15 minutes)")
    return a


def servers(a):
    """[(name, a started server or None, url)]: the URLs given, else ours with and without the store (started one
    at a time, when their turn comes), then the peer."""
    if a.url:
        out = []
        for i, u in enumerate(a.url):
            name, _, url = u.rpartition("=") if "=" in u.split("//")[0] else ("", "", u)
            out.append((name or f"server{i + 1}", None, url))
        return out
    out = [("store", launch.engine(threads=a.threads), None), ("no_store", launch.engine("--no-store",
                                                                                        threads=a.threads), None)]
    if a.peer:
        from common.gguf_llama import gguf_file
        out.append(("llama.cpp", launch.llama_cpp(gguf_file(None), launch.free_port(), a.threads), None))
    return out


def model_name(url: str, api_key: str | None) -> str:
    return bench.client_for(url, api_key).models.list().data[0].id


def run_one(a, name: str, url: str) -> tuple[list, tuple]:
    """The workloads on one server, then a long prompt it has not seen, sent twice: (runs, (first, again))."""
    from tqdm import tqdm
    model = a.model or model_name(url, a.api_key)
    runs = []
    todo = ([("rag", a.rag_requests)] if a.workload in ("rag", "both") else []) + \
        ([("chat", a.users * a.chat_turns)] if a.workload in ("chat", "both") else [])
    for workload, n in todo:
        with tqdm(total=n, desc=f"{name}: {workload}", leave=False) as bar:
            if workload == "rag":
                runs.append(bench.run_rag(name, url, model, users=a.users, requests=a.rag_requests,
                                          items=a.rag_items, max_tokens=a.max_tokens, docs=a.docs,
                                          kv_checks=KV_CHECKS if name == "store" else 0, api_key=a.api_key,
                                          progress=bar.update))
            else:
                runs.append(bench.run_chat(name, url, model, users=a.users, turns=a.chat_turns,
                                           max_tokens=a.max_tokens, api_key=a.api_key, progress=bar.update))
    return runs, bench.repeated_prompt(url, model, a.max_tokens, a.rag_items, a.api_key, docs=a.docs)


def same_answers(runs: list, base: str = "no_store") -> dict:
    """{(server, workload): share of its answers equal to `base`'s, request by request (greedy decoding)}."""
    ref = {(r.workload, s.user, s.turn): s.text for r in runs if r.server == base for s in r.samples}
    out = {}
    for r in runs:
        if r.server != base:
            pairs = [(s.text, ref.get((r.workload, s.user, s.turn))) for s in r.samples]
            pairs = [(x, y) for x, y in pairs if y is not None]
            out[r.server, r.workload] = sum(x == y for x, y in pairs) / len(pairs) if pairs else None
    return out


def shown(x, spec: str = "{:.2f}") -> str:
    return "-" if x is None else spec.format(x)


def show_repeats(page: Page, repeats: dict) -> None:
    rows = [Row([name, shown(first.ttft_s), shown(again.ttft_s),
                 shown(again.ttft_s / first.ttft_s if first.ttft_s and again.ttft_s else None),
                 "yes" if again.text == first.text else "no"]) for name, (first, again) in repeats.items()]
    page.table(Table(title="a long prompt no server has seen (a RAG item's documents in another order, a question of its "
                           "own), sent twice", section="§6",
                     cols=cols("server", "TTFT first, s", "TTFT again, s", "again / first", "same answer"),
                     rows=rows, source="engine.bench.repeated_prompt",
                     notes=["Our engine's second time reads the prompt's exact prefix from its store and prefills the "
                            "last token; llama.cpp's from its prompt cache."]))


def show(page: Page, runs: list, a) -> None:
    same = same_answers(runs)
    rows = [Row([r.server, r.workload, len(r.samples), r.errors, shown(r.p(0.5)), shown(r.p(0.99)), shown(r.queue_s),
                 shown(r.wall_s, "{:.1f}"), shown(r.tokens_per_s, "{:.1f}"), shown(r.cached_share, "{:.0%}"),
                 shown(same.get((r.server, r.workload)), "{:.0%}"), shown(r.summary().get("first_token_kl_mean"), "{:.3f}")])
            for r in runs]
    page.table(Table(title=f"{a.users} users at once, temperature 0, {a.max_tokens} answer tokens (TTFT in seconds, "
                           "measured by this client to the first streamed text)", section="§5.1, §6.3, §7",
                     cols=cols("server", "workload", "requests", "errors", "TTFT p50", "TTFT p99", "queued", "total, s",
                               "tokens/s", "from store", "same answer", "KL"),
                     rows=rows, source="engine.bench.run_rag",
                     notes=[f"{name}: reuses {REUSES.get(name, 'whatever it reuses')}." for name in
                            dict.fromkeys(r.server for r in runs)] +
                     ["queued: the mean time a request waited for the model inside its TTFT (our engine answers one "
                      "request at a time; -: the server does not say). From store: the prompt tokens the server says it served from its cache (OpenAI's cached_tokens; "
                      "-: it does not say). Same answer: the answer's text equal to no_store's for the same request "
                      "(greedy). KL: the first answer token's KL to a full prefill, measured by our engine (kv_check) "
                      "on RAG requests it blended."]))
    with page.figure("serve_bench.png", "time to first token, p50 (bar) and p99 (line)", figsize=(7, 3.5)) as (fig, ax):
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


def main(argv=None) -> list:
    a = parse(argv)
    page = Page("bench_serve", "an OpenAI-compatible server, benchmarked", "§5.1, §6.3, §7", plot=not a.no_plot)
    runs, repeats = [], {}
    for name, server, url in servers(a):
        if server is not None:
            server.start()
            print(f"{name}: {server.url} (pid {server.pid})", flush=True)
        try:
            done, repeats[name] = run_one(a, name, url or server.url)
            runs += done
        finally:
            if server is not None:
                server.stop()
    show(page, runs, a)
    show_repeats(page, repeats)
    if a.json:
        data = {"users": a.users, "runs": [{"server": r.server, "workload": r.workload, **r.summary()} for r in runs],
                "same_answer": {f"{s}/{w}": v for (s, w), v in same_answers(runs).items()},
                "repeat": {name: {"first_ttft_s": f.ttft_s, "again_ttft_s": g.ttft_s, "same_answer": f.text == g.text}
                           for name, (f, g) in repeats.items()}}
        Path(a.json).write_text(json.dumps(data, indent=2) + "\n")
        print(f"wrote {a.json}")
    return runs


if __name__ == "__main__":
    main()
