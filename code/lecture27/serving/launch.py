"""Start an engine (serve.py) as a process of its own on a free port of 127.0.0.1, wait until it serves, and stop
it by its PID (SIGTERM, then SIGKILL): what the benchmark, 05's Part "served" and the tests do with a server.
llama.cpp's OpenAI server (llama-cpp-python, when installed) starts the same way, as the peer beside ours."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

SERVE = Path(__file__).resolve().parents[1] / "serve.py"
START_TIMEOUT_S = 180.0      # a first start dequantizes SmolLM2's GGUF file once (then it is cached)
READY = re.compile(r"serving (\S+) at (http://\S+/v1)")


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
        self.proc = subprocess.Popen(self.argv, env=self.env, stdin=subprocess.PIPE if self.stdin else None,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
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
            if m and not found.is_set():   # (model, url) from ours, (url) from llama.cpp's
                *model, url = m.groups()
                self.model, self.url = (model[0] if model else self.model), url.removesuffix("/v1") + "/v1"
                found.set()

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 15 s; safe to call twice."""
        proc, self.proc = self.proc, None
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
    env = {k: v for k, v in os.environ.items() if k != "L27_REDIS_URL"}
    if redis_url:
        env["L27_REDIS_URL"] = redis_url
    return Server(argv, env)


LLAMA_CPP_READY = re.compile(r"Uvicorn running on (http://\S+)")


def llama_cpp_installed() -> bool:
    import importlib.util
    return importlib.util.find_spec("llama_cpp") is not None


def llama_cpp(gguf: Path, port: int, threads: int = 1, n_ctx: int = 4096) -> Server:
    """llama-cpp-python's OpenAI server on the same GGUF file, its prompt cache on (it reuses the longest common
    prefix of a prompt it has served, in RAM), ChatML as the file's template is."""
    argv = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", str(n_ctx),
            "--chat_format", "chatml", "--cache", "true", "--verbose", "false"]
    s = Server(argv, dict(os.environ), ready=LLAMA_CPP_READY)
    s.model = Path(gguf).name
    return s


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
