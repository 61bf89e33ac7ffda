"""A paced connection on this machine (handout §4.2 over a real socket, as CacheGen's evaluation streams
its bitstreams over a shaped link): a sender process writes a context's chunks to a localhost TCP
socket at the rate of a bandwidth trace, and a receiver reads them as they come.

The sender paces with a token bucket: from the moment a transfer may start (t0: asked for, and the link
free), the bucket fills at the trace's rate, one write of at most QUANTUM_BYTES at a time, and a write
goes once the bucket holds its bytes, i.e. when the trace would have carried every byte up to its end.
That plan (send_plan) is a pure function of the trace, so the last byte of a chunk is planned exactly
where streaming.Trace.transfer_end puts it; the sender sleeps to it, and how close it comes is measured.

A lecture-scale trace is scaled down before it drives the socket: its bandwidths are divided by
wire_scale(), the ratio of the lecture model's KV bytes per token to the small model's, so a chunk of the
small model's tokens takes as long on the scaled link as the lecture model's on the real one.

The receiver trusts only the sender it started: it makes a random token, hands it to the sender on its stdin
(with the payloads, as JSON and raw bytes: no command line, which any process may read, and nothing unpickled),
and the first connection whose first bytes are the token within PROOF_S is its sender; any other is closed.

Frames, receiver to sender: START (a run's clock origin and the trace it is paced to: one sender serves
run after run), REQUEST (chunk, option), PROBE (filler bytes until a time), CANCEL (stop the transfer under
way), STOP. Sender to receiver, per request: DATA pieces (one per paced write), then END (total bytes, the
CRC-32 of the chunk's own bytes, taken before a fault may flip one; the planned and the actual time of the
last write), or CANCELLED (the bytes sent, their CRC, the planned and actual time of the last write) when a
CANCEL came first. The sender waits for its next write by watching the socket, so a CANCEL stops it within
microseconds: the link is free again, as when the adaptive policy gives up a KV chunk stuck on a collapsed
link. A PROBE's DATA pieces (labelled PROBE_CHUNK) carry what the trace lets through each PROBE_TICK_S, so the
receiver measures the link's throughput over any window.
The receiver computes the same plan, so it knows each frame's kind, chunk and size before it comes, and when it
is due: a frame that differs from the plan raises WireProtocolError, and one not read by its write's planned time
plus MARGIN_S, or a sender that died (end of stream, reset), raises WireTimeout. Either way the sender is lost.
"""
from __future__ import annotations

import hmac
import json
import os
import secrets
import select
import signal
import socket
import struct
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass

from lecture27 import streaming as st
from common import timemodel as tm
from common.cli import module_command

LECTURE_MODEL = "llama-3.1-70b"  # 03's model (§4.1-4.2)
QUANTUM_BYTES = 16 * 1024        # one paced write: the pacing's granularity
MARGIN_S = 5.0                   # a frame not read this long after its write's planned time: the sender is gone
CONNECT_TIMEOUT_S = 60.0         # a spawned sender may take this long to connect on a busy machine
PROOF_S = 2.0                    # a connection has this long to send the token before it is closed
TOKEN_BYTES = 32                 # the receiver's random token, which its sender sends first
REAP_S = 5.0                     # a sender is given this long to exit before it is killed
GIVE_UP_POLL_S = 0.005          # a chunk's give-up time is asked again this often while its bytes come
PROBE_TICK_S = 0.002             # a probe writes what the trace lets through every this many seconds
PROBE_WINDOW_S = 0.02            # a probe's throughput: over its last window this long (about 10 writes)
PROBE_CHANGE = 2.0               # a probe stops one window after a window's throughput differs this much from
                                 # its first window's (the suite's rates are 2.5x or more apart)
PROBE_CHUNK = 0xFFFFFFFF         # the chunk a probe's DATA pieces are labelled with

_START = struct.Struct("<BdI")         # kind, epoch (time.monotonic of the run's t = 0), trace points;
_POINT = struct.Struct("<dd")          # then each point: from time s, Gb/s
_REQUEST = struct.Struct("<BII")       # kind, chunk, option index
_HEADER = struct.Struct("<BII")        # kind, chunk, piece bytes (DATA) or total bytes (END)
_END_TAIL = struct.Struct("<Idd")      # CRC-32 of the chunk's own bytes, planned and actual last write
_SETUP = struct.Struct("<I")           # the sender's stdin: the JSON header's length, the header, every chunk's bytes
_PROBE = struct.Struct("<Bd")          # kind, until (run's clock): the sender stops by itself then
START, REQUEST, STOP, DATA, END, PROBE, CANCEL, CANCELLED = 1, 2, 3, 4, 5, 6, 7, 8


class WireTimeout(Exception):
    """The sender stopped delivering: it died (end of stream, reset) or nothing came within the timeout."""


class WireProtocolError(WireTimeout):
    """The sender sent a frame the plan does not have (another kind, chunk or size): it counts as lost, as one
    that went silent does, and nothing it sent is used."""


def wire_scale(small_kv_bytes_per_token: int, lecture_model: str = LECTURE_MODEL) -> float:
    """The bandwidth divisor: the lecture model's KV bytes per token (FP16) over the small model's."""
    return tm.kv_bytes_per_token(lecture_model) / small_kv_bytes_per_token


def scaled(trace: st.Trace, divisor: float) -> st.Trace:
    """The same trace (same times, same shape) with every bandwidth divided by `divisor`."""
    return st.Trace(trace.times, tuple(g / divisor for g in trace.gbps))


def send_plan(trace: st.Trace, t0: float, nbytes: int, quantum: int = QUANTUM_BYTES) -> list:
    """When each write of a transfer of nbytes starting at t0 may go: [(time, bytes sent once it has)].
    The token bucket holds at most one write and fills at the trace's rate from t0, so write j (bytes up
    to c_j) goes when the trace has carried c_j bytes since t0."""
    ends = list(range(quantum, nbytes, quantum)) + [nbytes]
    return [(trace.transfer_end(t0, 8.0 * c), c) for c in ends]


def probe_plan(trace: st.Trace, t0: float, until: float, tick: float = PROBE_TICK_S) -> list:
    """A probe's writes from t0 to `until`: every `tick` seconds the filler bytes the trace carried since t0
    (cumulative), [(time, bytes sent once it has)]; a tick that adds no byte has no write."""
    out, k = [], 1
    while (t := t0 + k * tick) < until + tick:
        c = int((trace.bits_by(t) - trace.bits_by(t0)) / 8)
        if c > (out[-1][1] if out else 0):
            out.append((t, c))
        k += 1
    return out


def deadlines(plan: list, margin_s: float = MARGIN_S) -> list:
    """How long the receiver waits for each frame of a transfer planned as `plan` (send_plan's): until the
    plan's time for its write plus margin_s, on the same clock; the END frame goes with the last write."""
    return [t + margin_s for t, _ in plan] + [plan[-1][0] + margin_s]


def _recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes | None:
    """n bytes from sock, or None at a clean end of stream before the first byte; TimeoutError once
    time.monotonic() passes `deadline` (None: wait as the socket's own timeout says)."""
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("past the deadline")
            sock.settimeout(left)
        part = sock.recv(n - len(buf))
        if not part:
            if not buf:
                return None
            raise ConnectionResetError("the stream ended inside a frame")
        buf += part
    return bytes(buf)


@dataclass(frozen=True)
class Faults:
    """What a sender is told to do wrong: die (SIGKILL itself) once it has sent die_after_bytes payload
    bytes; flip the middle byte of the chunks in `corrupt` after their CRC is taken (the wire then carries bytes
    that are not the chunk's)."""
    die_after_bytes: int | None = None
    corrupt: frozenset = frozenset()


def write_setup(f, port: int, token: bytes, payloads: dict, quantum: int, faults: Faults) -> None:
    """What the sender is given on its stdin: a JSON header (the port, the token, the quantum, the faults,
    each option's chunk sizes) after its length, then every chunk's bytes, option by option."""
    head = json.dumps({"port": port, "token": token.hex(), "quantum": quantum,
                       "die_after_bytes": faults.die_after_bytes, "corrupt": sorted(faults.corrupt),
                       "sizes": {name: [len(c) for c in chunks] for name, chunks in payloads.items()}}).encode()
    f.write(_SETUP.pack(len(head)) + head)
    for chunks in payloads.values():
        for c in chunks:
            f.write(c)


def read_setup(f) -> dict:
    """write_setup's stream read back: port, token, payloads, names, quantum and faults (_sender's arguments)."""
    head = json.loads(f.read(_SETUP.unpack(f.read(_SETUP.size))[0]))
    payloads = {name: [f.read(n) for n in sizes] for name, sizes in head["sizes"].items()}
    return dict(port=head["port"], token=bytes.fromhex(head["token"]), payloads=payloads, names=tuple(payloads),
                quantum=head["quantum"], faults=Faults(head["die_after_bytes"], frozenset(head["corrupt"])))


def _sender(port: int, token: bytes, payloads: dict, names: tuple, quantum: int, faults: Faults) -> None:
    """The sender process: connect and send the token, then serve frames until STOP or the end of the stream.
    A START begins a run (its clock, its trace, the link free); a REQUEST is served whole before the next frame
    is read (the link carries one transfer at a time), paced by send_plan from max(asked, link free)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=CONNECT_TIMEOUT_S)
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)    # no Nagle delay on the END frame
    sock.sendall(token)
    epoch, trace, link_free, sent = 0.0, None, 0.0, 0

    def wait_until(t: float) -> bool | None:
        """Sleep until the run's time t, watching the socket: False at t, True once a CANCEL came (the transfer
        stops), None once STOP came or the stream ended (the sender stops)."""
        while (left := t - (time.monotonic() - epoch)) > 0:
            if select.select([sock], [], [], left)[0]:
                got = _recv_exact(sock, 1)
                if got is None or got[0] == STOP:
                    return None
                _recv_exact(sock, _REQUEST.size - 1)        # a CANCEL (nothing else comes during a transfer)
                return True
        return False

    while True:
        kind = _recv_exact(sock, 1)
        if kind is None or kind[0] == STOP:
            break
        if kind[0] == START:
            _, epoch, n = _START.unpack(kind + _recv_exact(sock, _START.size - 1))
            points = [_POINT.unpack(_recv_exact(sock, _POINT.size)) for _ in range(n)]
            trace, link_free = st.Trace(tuple(t for t, _ in points), tuple(g for _, g in points)), 0.0
            continue
        if kind[0] == CANCEL:                   # for a transfer that ended before it came: nothing to stop
            _recv_exact(sock, _REQUEST.size - 1)
            continue
        t0 = max(time.monotonic() - epoch, link_free)
        if kind[0] == PROBE:
            _, until = _PROBE.unpack(kind + _recv_exact(sock, _PROBE.size - 1))
            i, data, crc = PROBE_CHUNK, b"", 0
            plan = probe_plan(trace, t0, until)
        else:
            _, i, k = _REQUEST.unpack(kind + _recv_exact(sock, _REQUEST.size - 1))
            data = payloads[names[k]][i]
            crc = zlib.crc32(data)
            if i in faults.corrupt and data:
                data = data[:len(data) // 2] + bytes([data[len(data) // 2] ^ 0xFF]) + data[len(data) // 2 + 1:]
            plan = send_plan(trace, t0, len(data), quantum)
        pos, went, planned, stop = 0, t0, t0, False
        for t, end in plan:
            if (stop := wait_until(t)) is None:      # never early: wait until the plan's time
                sock.close()
                return
            if stop:
                break
            went, planned = time.monotonic() - epoch, t
            sock.sendall(_HEADER.pack(DATA, i, end - pos) + (data[pos:end] if data else bytes(end - pos)))
            sent += (end - pos) if data else 0       # a probe's filler is no payload
            pos = end
            if faults.die_after_bytes is not None and sent >= faults.die_after_bytes:
                os.kill(os.getpid(), signal.SIGKILL)
        if stop or kind[0] == PROBE:
            sock.sendall(_HEADER.pack(CANCELLED, i, pos) + _END_TAIL.pack(zlib.crc32(data[:pos]), planned, went))
            link_free = time.monotonic() - epoch
        else:
            sock.sendall(_HEADER.pack(END, i, len(data)) + _END_TAIL.pack(crc, plan[-1][0], went))
            link_free = plan[-1][0]
    sock.close()


def _accept_proven(listener: socket.socket, token: bytes, deadline: float) -> socket.socket:
    """The first connection whose first bytes are `token`, within PROOF_S of its accept; any other is closed
    and ignored. WireTimeout once time.monotonic() passes `deadline` with no sender proven."""
    while (left := deadline - time.monotonic()) > 0:
        listener.settimeout(left)
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            break
        try:
            proof = _recv_exact(conn, len(token), min(time.monotonic() + PROOF_S, deadline))
        except OSError:                       # silent past PROOF_S, or reset
            proof = None
        if proof is not None and hmac.compare_digest(proof, token):
            conn.settimeout(None)
            return conn
        conn.close()
    raise WireTimeout(f"no sender proved its token within {CONNECT_TIMEOUT_S:g} s")


@dataclass(frozen=True, kw_only=True)
class Arrival:
    """One chunk received. Times are on the run's clock (seconds since START): asked (request sent),
    last_byte (its last byte read), planned (the plan's last write), sent (when the sender made its last write).
    given_up: the chunk was not in by its give-up time, and its transfer was cancelled (data: the bytes that
    came before that; last_byte: when the receiver gave up)."""
    chunk: int
    option: str
    data: bytes
    crc_ok: bool
    asked: float
    last_byte: float
    planned: float
    sent: float
    given_up: bool = False

    @property
    def gbps(self) -> float:
        """The throughput this transfer measured, as the receiver sees it (request to last byte)."""
        return 8 * len(self.data) / max(self.last_byte - self.asked, 1e-9) / st.GBIT


class Wire:
    """A sender process and its socket, used as a context manager (the process is always reaped):
        with Wire(trace, {"level0": [chunk bytes, ...], "text": [...]}) as w:
            w.start(); a = w.fetch(0, "level0")
            w.start(other_trace); b = w.fetch(0, "text")      # a second run on the same sender
    The trace is the one the socket is paced to (already scaled); a start() may give another."""

    def __init__(self, trace: st.Trace, payloads: dict, quantum: int = QUANTUM_BYTES, margin_s: float = MARGIN_S,
                 faults: Faults = Faults()):
        self.trace, self.payloads, self.quantum = trace, payloads, quantum
        self.margin_s, self.faults = margin_s, faults
        self.names = tuple(payloads)
        self.epoch, self.link_free = None, 0.0     # link_free: when the last transfer's plan ends (run's clock)
        self.proc = self.sock = None
        self.broken = False            # a fetch failed: the sender is dead or stuck, and is killed at exit

    def __enter__(self) -> "Wire":
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.bind(("127.0.0.1", 0))
            listener.listen(8)             # the sender waits in the backlog while an impostor is refused
            token = secrets.token_bytes(TOKEN_BYTES)
            # a fresh interpreter that imports only this file (no fork of a process running torch threads)
            argv, env = module_command("lecture27.wire")
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, env=env)
            write_setup(self.proc.stdin, listener.getsockname()[1], token, self.payloads, self.quantum, self.faults)
            self.proc.stdin.close()
            self.sock = _accept_proven(listener, token, time.monotonic() + CONNECT_TIMEOUT_S)
        except BaseException:
            self._reap()
            raise
        finally:
            listener.close()
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return self

    def __exit__(self, *exc) -> None:
        self._reap()

    def _reap(self) -> None:
        if self.sock is not None:
            try:
                self.sock.sendall(_REQUEST.pack(STOP, 0, 0))
            except OSError:
                pass
            self.sock.close()
        if self.proc is not None:
            if self.broken:
                self.proc.kill()
            try:
                self.proc.wait(REAP_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def now(self) -> float:
        return time.monotonic() - self.epoch

    def start(self, trace: st.Trace | None = None) -> None:
        """A run's t = 0 (the trace's time origin): now; its link starts free, paced to `trace` (default:
        the Wire's)."""
        if self.broken:
            raise WireTimeout("the sender is gone: a run cannot start")
        self.trace = trace or self.trace
        self.epoch, self.link_free = time.monotonic(), 0.0
        self.sock.sendall(_START.pack(START, self.epoch, len(self.trace.times))
                          + b"".join(_POINT.pack(t, g) for t, g in zip(self.trace.times, self.trace.gbps)))

    def fetch(self, chunk: int, option: str, give_up_at=None) -> Arrival:
        """Ask for a chunk at an option and read it to its END frame. The sender paces it by send_plan from
        max(asked, link free), so each frame is expected as that plan has it (kind, chunk, size) by its
        deadlines() time. give_up_at (run's clock; a number, or a function asked again every GIVE_UP_POLL_S
        while the chunk's bytes come): if the chunk is not in by then, a CANCEL stops its transfer and the
        Arrival is given_up, with the bytes that came. Raises WireTimeout, or WireProtocolError for a frame
        the plan does not have."""
        if give_up_at is not None and not callable(give_up_at):
            give_up_at = (lambda at: lambda: at)(give_up_at)
        asked, size = self.now(), len(self.payloads[option][chunk])
        plan = send_plan(self.trace, max(asked, self.link_free), size, self.quantum)
        frames = [(DATA, chunk, b - a) for a, (_, b) in zip([0] + [c for _, c in plan], plan)] + [(END, chunk, size)]
        data, last, cancelled = bytearray(), asked, None
        try:
            self.sock.sendall(_REQUEST.pack(REQUEST, chunk, self.names.index(option)))
            for want, due in zip(frames, deadlines(plan, self.margin_s)):
                if want[0] == DATA and give_up_at is not None and cancelled is None and not self._comes(give_up_at):
                    cancelled = self.now()                 # not in by the give-up time: stop its transfer
                    self.sock.sendall(_REQUEST.pack(CANCEL, chunk, 0))
                head = self._head(chunk, option, want, due, len(data), size, cancelled is not None)
                if head[0] == CANCELLED:
                    crc, planned, sent = _END_TAIL.unpack(_recv_exact(self.sock, _END_TAIL.size, self.epoch + due))
                    if head[2] != len(data):
                        raise self._protocol(f"chunk {chunk} ({option}): cancelled after {head[2]} bytes, "
                                             f"{len(data)} came")
                    break
                if want[0] == END:
                    crc, planned, sent = _END_TAIL.unpack(_recv_exact(self.sock, _END_TAIL.size, self.epoch + due))
                else:
                    data += _recv_exact(self.sock, want[2], self.epoch + due)
                    last = self.now()
        except (OSError, TypeError) as e:     # socket.timeout is an OSError; TypeError: a frame cut short
            self.broken = True
            what = "no byte within the timeout" if isinstance(e, TimeoutError) else f"connection lost ({e})"
            raise WireTimeout(f"chunk {chunk} ({option}): {what} after {len(data)} bytes of {size}") from None
        self.link_free = plan[-1][0] if cancelled is None else 0.0
        data = bytes(data)
        if cancelled is not None:
            return Arrival(chunk=chunk, option=option, data=data, crc_ok=zlib.crc32(data) == crc, asked=asked,
                           last_byte=cancelled, planned=planned, sent=sent, given_up=True)
        return Arrival(chunk=chunk, option=option, data=data, crc_ok=zlib.crc32(data) == crc,
                       asked=asked, last_byte=last, planned=planned, sent=sent)

    def _comes(self, give_up_at) -> bool:
        """Whether the next frame comes before the give-up time, which give_up_at() says anew every
        GIVE_UP_POLL_S (it may move earlier while the bytes come)."""
        while (at := give_up_at()) > self.now():
            if self._ready_by(min(at, self.now() + GIVE_UP_POLL_S)):
                return True
        return False

    def _ready_by(self, t: float) -> bool:
        """Whether a frame is in, or comes, before the run's time t (False once t has passed)."""
        left = self.epoch + t - time.monotonic()
        return left > 0 and bool(select.select([self.sock], [], [], left)[0])

    def _protocol(self, msg: str) -> WireProtocolError:
        self.broken = True
        return WireProtocolError(msg)

    def _head(self, chunk, option, want, due, got, size, cancelled: bool) -> tuple:
        """The next frame's header, as the plan has it (`want`), or CANCELLED once a CANCEL was sent."""
        head = _recv_exact(self.sock, _HEADER.size, self.epoch + due)
        if head is None:
            raise ConnectionResetError("end of stream")
        got_head = _HEADER.unpack(head)
        if got_head != want and not (cancelled and got_head[:2] == (CANCELLED, chunk)):
            raise self._protocol(f"chunk {chunk} ({option}): a frame (kind, chunk, bytes) {got_head} where "
                                 f"the plan has {want}, after {got} bytes of {size}")
        return got_head

    def probe(self, until: float, window: float = PROBE_WINDOW_S, change: float = PROBE_CHANGE) -> tuple:
        """Probe bytes on the idle link from now until the run's time `until`, or one window after a
        window's throughput differs `change` times from the first window's (a change of rate seen):
        (the throughput over the last window, Gb/s; when the probe ended, run's clock). Raises WireTimeout."""
        start = self.now()
        arrivals, total, seen = [(start, 0)], 0, None     # (when, bytes so far) per piece read
        try:
            self.sock.sendall(_PROBE.pack(PROBE, until))
            cancelled = False
            while True:
                end = until if seen is None else min(until, seen + window)
                if not cancelled and not self._ready_by(end):
                    cancelled = True
                    self.sock.sendall(_REQUEST.pack(CANCEL, PROBE_CHUNK, 0))
                head = _recv_exact(self.sock, _HEADER.size, time.monotonic() + self.margin_s)
                if head is None:
                    raise ConnectionResetError("end of stream")
                kind, i, n = _HEADER.unpack(head)
                if i != PROBE_CHUNK or kind not in (DATA, CANCELLED):
                    raise self._protocol(f"probe: a frame (kind, chunk, bytes) {(kind, i, n)} where the probe has "
                                         f"its own ({PROBE_CHUNK})")
                if kind == CANCELLED:
                    _recv_exact(self.sock, _END_TAIL.size, time.monotonic() + self.margin_s)
                    break
                if n > self.quantum_cap():
                    raise self._protocol(f"probe: a piece of {n} bytes, past {self.quantum_cap()}")
                _recv_exact(self.sock, n, time.monotonic() + self.margin_s)
                total += n
                arrivals.append((self.now(), total))
                if seen is None and _rate_change(arrivals, window, change):
                    seen = arrivals[-1][0]
        except (OSError, TypeError) as e:
            self.broken = True
            raise WireTimeout(f"probe: connection lost ({e})") from None
        self.link_free = 0.0
        if total == 0:     # not a byte through: at most one byte over the probe's seconds (never 0, see WireLink)
            return 8 / max(self.now() - start, 1e-9) / st.GBIT, self.now()
        return _window_gbps(arrivals, window), self.now()

    def quantum_cap(self) -> int:
        """The largest piece a probe may send: what the trace's fastest rate carries in a tick (and a quantum)."""
        return self.quantum + int(max(self.trace.gbps) * st.GBIT * PROBE_TICK_S / 8) + 1


def _window_gbps(arrivals: list, window: float) -> float:
    """The throughput of a probe's last `window` seconds: the bytes read after the first piece at least a window
    before the last one, over the time between (from the probe's start when none is that old). Gb/s."""
    t1, c1 = arrivals[-1]
    t0, c0 = next(((t, c) for t, c in reversed(arrivals) if t1 - t >= window), arrivals[0])
    return 8 * (c1 - c0) / max(t1 - t0, 1e-9) / st.GBIT


def _rate_change(arrivals: list, window: float, change: float) -> bool:
    """Whether the last window's throughput differs `change` times from the first window's (both full windows)."""
    t_first = arrivals[0][0]
    if arrivals[-1][0] - t_first < 2 * window:
        return False
    head = [(t, c) for t, c in arrivals if t - t_first <= window]
    first = 8 * (head[-1][1] - arrivals[0][1]) / max(head[-1][0] - t_first, 1e-9) / st.GBIT
    last = _window_gbps(arrivals, window)
    return first <= 0 or last <= 0 or not (1 / change <= last / first <= change)


if __name__ == "__main__":      # the sender process: its arguments come on stdin from Wire (write_setup)
    _sender(**read_setup(sys.stdin.buffer))
