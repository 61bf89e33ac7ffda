"""Start an engine (serve.py) as a process of its own on a free port of 127.0.0.1, wait until it serves, and stop
it by its PID (SIGTERM, then SIGKILL): what the benchmark, 05's Part "served" and the tests do with a server.
A server also stops when its owner ends: at exit, on SIGTERM (made to unwind as Ctrl-C does), and on Linux however
the owner dies (the kernel's parent-death signal, as for the Redis servers: common/redis_server.spawn).
The peers beside ours start the same way: vLLM's OpenAI server (its CPU build, in a venv of its own) and
llama.cpp's llama-server, each found in the peers' folder outside the clone ($L27_PEERS, else
~/.cache/lecture27-peers: install_peers.sh puts them there; a venv's thousands of files stay out of the project's
tree) or where L27_VLLM_PYTHON / L27_LLAMA_SERVER say; the weights vLLM loads are kept in the checkpoint folder."""
from __future__ import annotations

import atexit
import hashlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from common.redis_server import ON_SIGTERM, URL_ENV, exit_on_sigterm, spawn

SERVE = Path(__file__).resolve().parents[1] / "serve.py"
START_TIMEOUT_S = 180.0      # a first start dequantizes SmolLM2's GGUF file once (then it is cached)
READY = re.compile(r"serving (\S+) at (http://\S+/v1)")


OTHER_PROGRAMS = ("run_all", "shipped_settings", "bench_serve", "gpu_check")   # with the numbered scripts: never run
                                                                               # by an engine process


def engine_source() -> str:
    """A hash of the code an engine process runs (serve.py, engine/, the mechanisms and common/, not the other
    programs: an edit of 04's constants does not measure 05's served engine again): the key a measurement of a
    served engine is cached under, since that code runs in another process, out of reach of the cache's walk of
    the caller's functions."""
    code = SERVE.parent
    mechanisms = [f for f in code.glob("*.py") if not f.stem[:2].isdigit() and f.stem not in OTHER_PROGRAMS]
    files = sorted([SERVE, *code.glob("engine/*.py"), *mechanisms, *code.parent.glob("common/*.py")])
    h = hashlib.sha256()
    for f in dict.fromkeys(files):
        h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()[:16]


RUNNING: set = set()   # the server processes started here and not yet stopped


def _tell_servers() -> None:
    """SIGTERM to this process: each server gets it at once, so that it ends its open streams and the clients
    waiting on them return (a client's thread would otherwise hold the unwinding until its answer ended)."""
    for proc in list(RUNNING):
        proc.send_signal(signal.SIGTERM)


ON_SIGTERM.append(_tell_servers)


class Server:
    """A server process: `with Server([...]) as s: s.url`. Its output is kept in s.lines (for a test's message)."""

    def __init__(self, argv: list, env: dict | None = None, ready=READY, stdin: str | None = None,
                 timeout: float = START_TIMEOUT_S):
        self.argv, self.env, self.ready, self.stdin, self.timeout = argv, env, ready, stdin, timeout
        self.proc, self.url, self.model, self.lines = None, None, None, []

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def start(self) -> "Server":
        exit_on_sigterm()
        self.proc = spawn(self.argv, env=self.env, stdin=subprocess.PIPE if self.stdin else None,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        atexit.register(self.stop)
        RUNNING.add(self.proc)
        if self.stdin:
            self.proc.stdin.write(self.stdin)
            self.proc.stdin.close()
        found = threading.Event()
        threading.Thread(target=self._read, args=(found,), daemon=True).start()
        deadline = time.monotonic() + self.timeout
        while not found.wait(0.1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = " | ".join(self.lines[-3:]) or "no output"
                raise RuntimeError(f"the server did not start ({' '.join(map(str, self.argv[1:3]))}): {tail}")
        return self

    def _read(self, found: threading.Event) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())
            m = self.ready.search(line)
            if m and not found.is_set():   # (model, url) from ours, (url) from llama.cpp's, () from vLLM's
                *model, url = m.groups() or (self.url,)
                self.model, self.url = (model[0] if model else self.model), url.removesuffix("/v1") + "/v1"
                found.set()

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 15 s; safe to call twice."""
        proc, self.proc = self.proc, None
        atexit.unregister(self.stop)
        RUNNING.discard(proc)
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def __enter__(self) -> "Server":
        return self if self.proc is not None else self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def engine(*flags: str, threads: int = 1, redis_url: str | None = None) -> Server:
    """Our engine (serve.py) on a free port with these flags. A Redis URL goes in the environment, where a
    password stays off the command line."""
    argv = [sys.executable, str(SERVE), "--port", "0", "--threads", str(threads), *flags]
    env = {k: v for k, v in os.environ.items() if k != URL_ENV}
    if redis_url:
        env[URL_ENV] = redis_url
    return Server(argv, env)


# ------------------------------------------------------------------------------------------------ the peers
PEERS = ("vllm", "llama.cpp")
INSTALL = "code/lecture27/serving/install_peers.sh"
VLLM_START_TIMEOUT_S = 900.0   # vLLM's CPU backend compiles its model graph at start (about 3 minutes here)
VLLM_KV_GB = 1                 # VLLM_CPU_KVCACHE_SPACE: GiB of KV blocks (SmolLM2 holds about 21,700 tokens a GB)
VLLM_MAX_LEN = 8192            # SmolLM2's context
VLLM_READY = re.compile(r"Application startup complete")   # it logs its URL before it listens
LLAMA_READY = re.compile(r"listening on (http://\S+)")
LLAMA_SLOTS = 4                # --parallel: requests batched together (continuous batching)
LLAMA_SLOT_CTX = 4096          # tokens a slot holds: a RAG prompt of 6 documents is about 1,700
LLAMA_CACHE_REUSE = 256        # --cache-reuse: the shortest run of cached tokens shifted to a new place


def peers_dir() -> Path:
    """The peers' programs: $L27_PEERS, else ~/.cache/lecture27-peers."""
    return Path(os.environ.get("L27_PEERS") or Path.home() / ".cache" / "lecture27-peers")


def peer_path(name: str) -> Path:
    """Where the peer is looked for: vLLM's Python ($L27_VLLM_PYTHON, else <peers>/vllm-venv/bin/python) or
    llama-server ($L27_LLAMA_SERVER, else <peers>/bin/llama-server)."""
    if name == "vllm":
        env = os.environ.get("L27_VLLM_PYTHON")
        return Path(env) if env else peers_dir() / "vllm-venv" / "bin" / "python"
    if name == "llama.cpp":
        env = os.environ.get("L27_LLAMA_SERVER")
        return Path(env) if env else peers_dir() / "bin" / "llama-server"
    raise ValueError(f"unknown peer {name!r} (one of {', '.join(PEERS)})")


def peer_missing(name: str) -> str | None:
    """None when the peer is there; else one line that says where it was looked for and how to install it."""
    path, fix = peer_path(name), f"install it with `bash {INSTALL} {name}` (docs/peers.md)"
    env = "L27_VLLM_PYTHON" if name == "vllm" else "L27_LLAMA_SERVER"
    if not (path.is_file() and os.access(path, os.X_OK)):
        what = "vLLM's Python" if name == "vllm" else "llama-server"
        return f"--peer {name}: no {what} at {path} ({fix}, or set {env})"
    if name == "vllm":
        has = subprocess.run([str(path), "-c", "import importlib.util, sys; "
                              "sys.exit(importlib.util.find_spec('vllm') is None)"], capture_output=True)
        if has.returncode != 0:
            return f"--peer vllm: {path} has no vllm module ({fix}, or set {env})"
        if not (vllm_weights() / "config.json").is_file():
            return f"--peer vllm: no float32 SmolLM2 at {vllm_weights()} ({fix}: it converts the GGUF file)"
    return None


def vllm_weights() -> Path:
    """The folder vLLM loads: SmolLM2's GGUF file dequantized to float32 by transformers and saved as a plain
    Llama checkpoint (the weights our engine computes with), in the checkpoint folder. install_peers.sh writes it."""
    from common.checkpoints import checkpoint_dir
    return checkpoint_dir() / "peers" / "smollm2-135m-f32"


CONVERT = """\
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM
gguf, out = sys.argv[1], sys.argv[2]
folder, name = gguf.rsplit("/", 1)
src = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, torch_dtype=torch.float32)
config = src.config
if hasattr(config, "quantization_config"):   # the weights are dequantized: no loader should look for GGUF
    del config.quantization_config
dst = LlamaForCausalLM(config).to(torch.float32)
dst.load_state_dict(src.state_dict())
dst.save_pretrained(out)
AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)
print("wrote", out)
"""


def thread_env(threads: int) -> dict:
    """The environment of a peer: every OpenMP/BLAS pool at `threads`."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads))
    return env


def vllm(port: int, threads: int = 1, python: Path | None = None, weights: Path | None = None) -> Server:
    """vLLM's OpenAI server (its CPU build) on 127.0.0.1:port: the float32 weights, its prefix cache on (blocks of
    16 tokens keyed by every token before them: exact prefixes), `threads` OpenMP threads (OMP_NUM_THREADS and
    VLLM_CPU_OMP_THREADS_BIND: the first `threads` cores), VLLM_KV_GB of KV blocks. The `vllm` command does not
    start from this build (its package is named vllm-cpu), so the module runs. --enable-prompt-tokens-details:
    usage says how many prompt tokens came from the prefix cache (OpenAI's cached_tokens)."""
    weights = weights or vllm_weights()
    argv = [str(python or peer_path("vllm")), "-m", "vllm.entrypoints.openai.api_server", "--model", str(weights),
            "--served-model-name", weights.name, "--dtype", "float32", "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--max-model-len", str(VLLM_MAX_LEN), "--host", "127.0.0.1", "--port", str(port)]
    env = thread_env(threads)
    env.update(VLLM_CPU_KVCACHE_SPACE=str(VLLM_KV_GB), VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}",
               VLLM_TARGET_DEVICE="cpu")
    s = Server(argv, env, ready=VLLM_READY, timeout=VLLM_START_TIMEOUT_S)
    s.model, s.url = weights.name, f"http://127.0.0.1:{port}/v1"
    return s


def llama_server(gguf: Path, port: int, threads: int = 1, binary: Path | None = None) -> Server:
    """llama.cpp's llama-server on 127.0.0.1:port, on the GGUF file itself (it computes with the file's 4-bit
    weights): LLAMA_SLOTS requests batched continuously, each slot LLAMA_SLOT_CTX tokens, its prompt cache with
    --cache-reuse (runs of LLAMA_CACHE_REUSE or more cached tokens that come back later in a prompt are shifted
    there by RoPE, nothing recomputed), ChatML as the file's template is, `threads` threads for answers and
    prompts."""
    argv = [str(binary or peer_path("llama.cpp")), "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "--threads", str(threads), "--threads-batch", str(threads), "--parallel", str(LLAMA_SLOTS),
            "--cont-batching", "--cache-reuse", str(LLAMA_CACHE_REUSE), "--ctx-size", str(LLAMA_SLOTS * LLAMA_SLOT_CTX),
            "--chat-template", "chatml", "--no-webui"]
    s = Server(argv, thread_env(threads), ready=LLAMA_READY)
    s.model = Path(gguf).name
    return s


def peer(name: str, threads: int = 1) -> Server:
    """The peer of that name (PEERS) on a free port of 127.0.0.1 with `threads` threads: vLLM's server on
    SmolLM2's float32 weights, llama-server on the GGUF file."""
    if name == "vllm":
        return vllm(free_port(), threads)
    from common.gguf_llama import gguf_file
    return llama_server(gguf_file(None), free_port(), threads)


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
