"""Admission by memory, measured: many long prompts sent at once to serve.py under a small KV budget (--kv-gb). Each
answer must equal the one the engine gives the same prompt alone (sent again afterwards, one at a time); the
server's peak resident memory (VmHWM, its whole process: weights, KV, activations) is printed beside the budget
and the most KV its running requests held (GET /health's kv_bytes, polled while they run).

    python -m lecture27.serving.memory                   # from code/: 32 prompts of 6,000 tokens, --kv-gb 0.6
    python -m lecture27.serving.memory --requests 4      # fewer (one 6,000-token prompt: about a minute, one thread)

A benchmark, not a test: the numbers are this machine's. The budget bounds the KV; the rest of the process is the
model's float32 weights (about 0.54 GB), the prefill's activations and the Python runtime.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common.cli import Parser, positive_float, positive_int
from lecture27.serving import bench, launch

REQUESTS = 32           # prompts sent at once
PROMPT_TOKENS = 6000    # about this many tokens each (the project's prose, repeated, then a question)
KV_GB = 0.6             # serve.py --kv-gb: two such requests at once (each counted at ~0.28 GB in float32)
MAX_TOKENS = 8          # answer tokens each
THREADS = 2             # the server's torch threads
CHARS_PER_TOKEN = 4.6   # the project's prose in SmolLM2's tokenizer (the usage's prompt_tokens are printed)
TIMEOUT_S = 3600.0      # a request's client waits this long: the last of 32 waits for 31 prefills of 6,000 tokens


def prompt(n: int, tokens: int) -> list:
    """Prose of about `tokens` tokens (CHARS_PER_TOKEN), numbered so that no two prompts are alike, then a question
    about it."""
    from common.english import CALIBRATION
    text, i = f"Text number {n}.\n\n", n
    chars = int(CHARS_PER_TOKEN * tokens)
    while len(text) < chars:
        text += CALIBRATION[i % len(CALIBRATION)] + "\n\n"
        i += 1
    return [{"role": "user", "content": text[:chars] + "\n\nWhat is the number of this text?"}]


def peak_rss_gb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 / 1e9
    return float("nan")


def run(requests: int, tokens: int, kv_gb: float, max_tokens: int, threads: int) -> dict:
    """The benchmark: {"answers_equal", "requests", "prompt_tokens", "peak_rss_gb", "kv_gb", "kv_peak_gb",
    "running_peak", "seconds"}."""
    prompts = [prompt(n, tokens) for n in range(requests)]
    with launch.engine("--no-store", "--kv-gb", str(kv_gb), threads=threads).start() as s:
        client, seen, done = bench.client_for(s.url, timeout=TIMEOUT_S), [], threading.Event()

        def ask(messages) -> tuple[str, int]:
            r = client.chat.completions.create(model=s.model, messages=messages, max_tokens=max_tokens, temperature=0)
            return r.choices[0].message.content, r.usage.prompt_tokens

        def watch() -> None:
            while not done.is_set():
                if (h := bench.health(s.url)) is not None:
                    seen.append((h["kv_bytes"], h["running"]))
                time.sleep(0.05)
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        t0 = time.perf_counter()
        with ThreadPoolExecutor(requests) as pool:
            together = list(pool.map(ask, prompts))
        seconds = time.perf_counter() - t0
        done.set()
        alone = [ask(p) for p in prompts]
        rss = peak_rss_gb(s.pid)
    return {"requests": requests, "answers_equal": sum(a == b for a, b in zip(together, alone)), "kv_gb": kv_gb,
            "prompt_tokens": [n for _, n in together],
            "kv_peak_gb": max(k for k, _ in seen) / 1e9, "running_peak": max(r for _, r in seen),
            "peak_rss_gb": rss, "seconds": seconds}


def main(argv=None) -> None:
    p = Parser(__doc__, json=False)
    p.add_argument("--requests", type=positive_int, default=REQUESTS, help="prompts sent at once")
    p.add_argument("--prompt-tokens", type=positive_int, default=PROMPT_TOKENS, help="tokens a prompt, about")
    p.add_argument("--kv-gb", type=positive_float, default=KV_GB, help="the server's KV budget, GB")
    p.add_argument("--max-tokens", type=positive_int, default=MAX_TOKENS, help="answer tokens each")
    p.add_argument("--threads", type=positive_int, default=THREADS, help="the server's torch threads")
    a = p.parse_args(argv)
    r = run(a.requests, a.prompt_tokens, a.kv_gb, a.max_tokens, a.threads)
    n = r["prompt_tokens"]
    print(f"{r['requests']} prompts of {min(n):,}-{max(n):,} tokens sent at once, --kv-gb {r['kv_gb']:g}: "
          f"{r['answers_equal']}/{r['requests']} answers equal to the same prompt's alone, all answered in "
          f"{r['seconds']:.0f} s; at most {r['running_peak']} running, their KV counted at {r['kv_peak_gb']:.2f} GB "
          f"(budget {r['kv_gb']:g} GB); the server's peak resident memory {r['peak_rss_gb']:.2f} GB")


if __name__ == "__main__":
    main()
