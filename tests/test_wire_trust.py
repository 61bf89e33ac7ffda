"""Whom wire.Wire trusts and what it takes from them: only the sender it started (it proves a token given on its
stdin, never on a command line), only the frames the plan has (kind, chunk, size), a probe's
own pieces and a CANCELLED that answers its CANCEL, and a sender on its plan however slow the trace.

A test double of the sender is this file run as a program (`python tests/test_wire_trust.py MODE`, put in
place of the real sender through wire.module_command): it proves the token as the real one does, then answers
a REQUEST, a PROBE or a CANCEL as MODE says. No test bounds a time: the machine is shared."""
import io
import json
import secrets
import socket
import sys
import zlib

import pytest

from lecture27 import wire
from lecture27 import streaming as st
from common.cli import module_command

PAYLOADS = {"a": [bytes(range(256)) * 4, b"\x07" * 1024]}     # two chunks of 1 KB: only their bytes differ
QUANTUM = 256                                                  # chunk 0 is four paced writes


def _data(i: int, piece: bytes) -> bytes:
    return wire._HEADER.pack(wire.DATA, i, len(piece)) + piece


def _end(i: int, data: bytes, total: int | None = None) -> bytes:
    return wire._HEADER.pack(wire.END, i, len(data) if total is None else total) + \
        wire._END_TAIL.pack(zlib.crc32(data), 0.0, 0.0)


def _chunk(i: int, data: bytes, q: int) -> list:
    """A chunk's frames as a sender sends them (labelled chunk i, each piece at most q bytes), with their CRC."""
    return [_data(i, data[a:a + q]) for a in range(0, max(len(data), 1), q)] + [_end(i, data)]


# what a rogue sender answers a REQUEST for chunk i (chunks: the option's, q: the quantum): every answer but
# "silent" comes with a CRC that matches the bytes it carries
ROGUES = {
    "another chunk": lambda chunks, i, q: _chunk(1 - i, chunks[1 - i], q),
    "a 3 MB frame labelled chunk 99": lambda chunks, i, q: [_data(99, bytes(3_000_000)), _end(99, bytes(3_000_000))],
    "a piece past the quantum": lambda chunks, i, q: _chunk(i, chunks[i], 2 * q),
    "a total past the chunk": lambda chunks, i, q: _chunk(i, chunks[i] + bytes(q), q),
    "an END total not what arrived": lambda chunks, i, q: _chunk(i, chunks[i], q)[:-1] + [
        _end(i, chunks[i], len(chunks[i]) + 1)],
    "a frame of no kind": lambda chunks, i, q: [wire._HEADER.pack(9, i, 0)],
    "silent": lambda chunks, i, q: [],
}
_TAIL = wire._END_TAIL.pack(0, 0.0, 0.0)
# what a rogue sender answers a PROBE (the probe's pieces are labelled wire.PROBE_CHUNK, at most a tick's bytes)
PROBE_ROGUES = {
    "a probe piece labelled chunk 0": [_data(0, bytes(8))],
    "a 3 MB probe piece": [_data(wire.PROBE_CHUNK, bytes(3_000_000))],
    "a probe that ENDs": [wire._HEADER.pack(wire.END, wire.PROBE_CHUNK, 0) + _TAIL],
}
# what a rogue sender that sends no byte of chunk i answers the CANCEL that follows (or, unasked, the REQUEST)
CANCEL_ROGUES = {
    "cancelled after bytes that never came": lambda i: [wire._HEADER.pack(wire.CANCELLED, i, 5) + _TAIL],
    "cancelled, another chunk": lambda i: [wire._HEADER.pack(wire.CANCELLED, 1 - i, 0) + _TAIL],
}
UNASKED = "cancelled before any CANCEL"


def _rogue(mode: str) -> None:
    """The sender double: read the setup from stdin, connect and prove the token, read START frames, and
    answer each REQUEST with ROGUES[mode]'s frames; until STOP or the end of the stream."""
    setup = wire.read_setup(sys.stdin.buffer)
    sock = socket.create_connection(("127.0.0.1", setup["port"]))
    sock.sendall(setup["token"])
    while (kind := wire._recv_exact(sock, 1)) is not None and kind[0] != wire.STOP:
        if kind[0] == wire.START:
            _, _, n = wire._START.unpack(kind + wire._recv_exact(sock, wire._START.size - 1))
            wire._recv_exact(sock, n * wire._POINT.size)
            continue
        if kind[0] == wire.PROBE:
            wire._recv_exact(sock, wire._PROBE.size - 1)
            frames = PROBE_ROGUES.get(mode, [])
        else:
            _, i, k = wire._REQUEST.unpack(kind + wire._recv_exact(sock, wire._REQUEST.size - 1))
            if kind[0] == wire.CANCEL:
                frames = CANCEL_ROGUES[mode](i) if mode in CANCEL_ROGUES else []
            elif mode == UNASKED:
                frames = [wire._HEADER.pack(wire.CANCELLED, i, 0) + _TAIL]
            else:
                frames = ROGUES.get(mode, lambda *_: [])(setup["payloads"][setup["names"][k]], i, setup["quantum"])
        for frame in frames:
            sock.sendall(frame)
    sock.close()


@pytest.fixture
def rogue(monkeypatch):
    """rogue(mode): the next Wire starts this file's sender double in `mode` instead of the real sender."""
    def use(mode: str) -> None:
        argv, env = module_command("lecture27.wire")
        monkeypatch.setattr(wire, "module_command", lambda module: ([sys.executable, __file__, mode], env))
    return use


def _closed(sock: socket.socket) -> bool:
    """The peer closed sock (its end of stream, or a reset), waiting at most 60 s."""
    sock.settimeout(60.0)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_an_impostor_that_connects_first_is_refused(monkeypatch):
    """Two connections reach the Wire's port before its sender can (made the moment it listens): one sends 32
    wrong bytes, one sends nothing. Both are closed, and the run reads its chunks from its own sender."""
    impostors, listen = [], socket.socket.listen

    def listen_then_impostors(self, *args):
        listen(self, *args)
        for first in (b"\xaa" * 32, b""):
            impostors.append(socket.create_connection(self.getsockname()))
            impostors[-1].sendall(first)

    monkeypatch.setattr(socket.socket, "listen", listen_then_impostors)
    try:
        with wire.Wire(st.Trace.steady(0.05), PAYLOADS) as w:
            assert len(impostors) == 2 and all(_closed(s) for s in impostors)
            w.start()
            got = [w.fetch(i, "a") for i in range(2)]
        assert [g.data for g in got] == PAYLOADS["a"] and all(g.crc_ok for g in got)
        assert w.proc.poll() is not None
    finally:
        for s in impostors:
            s.close()


def _sender_lost(error, match: str, call, **wire_kw):
    """On the rogue sender: call(w) raises `error` (its message matching `match`), the Wire counts its sender lost
    and the sender is killed. -> the error."""
    with wire.Wire(st.Trace.steady(0.05), PAYLOADS, **wire_kw) as w:
        w.start()
        with pytest.raises(error, match=match) as e:
            call(w)
        assert w.broken
    assert w.proc.poll() is not None
    return e.value


@pytest.mark.parametrize("mode", [m for m in ROGUES if m != "silent"])
def test_a_frame_the_plan_does_not_have_is_a_protocol_error(rogue, mode):
    """A sender that proves the token, then answers chunk 0 with frames the plan does not have (each with a
    CRC that matches what it carries): fetch raises WireProtocolError (a WireTimeout: the sender is lost),
    never an Arrival, and the sender is killed."""
    rogue(mode)
    _sender_lost(wire.WireProtocolError, "chunk 0 .a.: a frame", lambda w: w.fetch(0, "a"), quantum=QUANTUM)
    assert issubclass(wire.WireProtocolError, wire.WireTimeout)


@pytest.mark.parametrize("mode", PROBE_ROGUES)
def test_a_probe_answered_with_frames_it_does_not_have_is_a_protocol_error(rogue, mode):
    """A PROBE answered with a piece labelled a chunk, a piece larger than the trace lets through a tick, or an
    END: WireProtocolError, the sender lost and killed."""
    rogue(mode)
    _sender_lost(wire.WireProtocolError, "probe: a", lambda w: w.probe(w.now() + 0.05), quantum=QUANTUM)


def test_a_probe_never_answered_times_out(rogue):
    """A PROBE, then the CANCEL that stops it, answered by nothing: WireTimeout, not a probe's rate."""
    rogue("silent")
    _sender_lost(wire.WireTimeout, "probe: connection lost", lambda w: w.probe(w.now() + 0.05), margin_s=0.2)


@pytest.mark.parametrize("mode", [*CANCEL_ROGUES, UNASKED])
def test_a_cancelled_frame_that_does_not_match_the_cancel_is_a_protocol_error(rogue, mode):
    """Chunk 0 sends no byte by its give-up time, so the Wire sends a CANCEL; the sender answers CANCELLED
    after bytes that never came, or for another chunk; or CANCELLED comes before any CANCEL was sent:
    WireProtocolError, never a given-up Arrival."""
    rogue(mode)
    _sender_lost(wire.WireProtocolError, "chunk 0 .a.: ",
                 lambda w: w.fetch(0, "a", give_up_at=None if mode == UNASKED else w.now() + 0.05),
                 quantum=QUANTUM, margin_s=5.0)


def test_a_silent_sender_times_out(rogue):
    """A sender that proves the token, then sends nothing: no frame by its planned time plus the margin."""
    rogue("silent")
    e = _sender_lost(wire.WireTimeout, "no byte within the timeout", lambda w: w.fetch(0, "a"), margin_s=0.2)
    assert not isinstance(e, wire.WireProtocolError)


def test_a_run_whose_sender_sends_another_chunk_falls_back_to_text(tiny, rogue):
    """Asked for chunk 0, the sender sends chunk 1 (its own label, its own CRC): the run counts the sender as
    lost at chunk 0, as for a dead one, recomputes every chunk from text and answers right."""
    from lecture27.stream import wire_runs
    model, prep = tiny
    rogue("another chunk")
    r = wire_runs.run(prep, model, st.Trace((0.0, 0.05), (0.0008, 0.0003)), "level0", 0.3)
    assert r.fell_back and r.choices == ["text"] * 4 and r.rows[0].arrival is None
    assert r.rows[0].lost.startswith("chunk 0 (level0): a frame")
    assert r.bytes_equal and r.same_answer and r.first_token_kl < 1e-3


def test_each_frame_is_due_by_its_planned_write_plus_the_margin():
    """The receiver waits for each frame until its write's planned time plus MARGIN_S (the END with the last
    write), however long the trace makes one write: here a 16 KB write takes 40 s."""
    tr = st.Trace((0.0, 100.0), (8 * 16_384 / 40.0 / st.GBIT, 1.0))
    plan = wire.send_plan(tr, 1.0, 40_000)
    due = wire.deadlines(plan)
    assert due == [t + wire.MARGIN_S for t, _ in plan] + [plan[-1][0] + wire.MARGIN_S]
    assert due[0] == pytest.approx(1.0 + 40.0 + wire.MARGIN_S) and due[1] == pytest.approx(81.0 + wire.MARGIN_S)
    assert wire.deadlines(plan, 0.5)[-1] == plan[-1][0] + 0.5


@pytest.mark.slow
def test_a_live_sender_whose_one_write_takes_over_5_s_is_not_lost():
    """One 1 KB write paced to take 5.5 s (longer than a fixed 5 s timeout): the chunk arrives whole."""
    tr = st.Trace.steady(8 * 1024 / 5.5 / st.GBIT)
    with wire.Wire(tr, {"a": [bytes(range(256)) * 4]}, quantum=1024) as w:
        w.start()
        got = w.fetch(0, "a")
    assert got.data == bytes(range(256)) * 4 and got.crc_ok and got.planned > 5.0


def test_the_token_is_never_on_the_senders_command_line(monkeypatch):
    """The token the Wire makes (secrets.token_bytes) is in neither the spawned sender's argv nor its
    environment, both read from /proc; the sender proves it all the same (a chunk is fetched)."""
    made, token_bytes = [], secrets.token_bytes
    monkeypatch.setattr(secrets, "token_bytes", lambda n: made.append(token_bytes(n)) or made[-1])
    with wire.Wire(st.Trace.steady(0.05), PAYLOADS) as w:
        with open(f"/proc/{w.proc.pid}/cmdline", "rb") as f:
            cmdline = f.read()
        with open(f"/proc/{w.proc.pid}/environ", "rb") as f:
            environ = f.read()
        w.start()
        assert w.fetch(0, "a").data == PAYLOADS["a"][0]
    assert len(made) == 1 and len(made[0]) == wire.TOKEN_BYTES
    assert cmdline.split(b"\0")[:-1] == [a.encode() for a in module_command("lecture27.wire")[0]]
    for secret in (made[0], made[0].hex().encode(), made[0].hex().upper().encode()):
        assert secret not in cmdline and secret not in environ


def test_the_senders_stdin_is_json_and_raw_bytes():
    """What the sender reads on its stdin: a length, a JSON header, then the chunks' bytes as they are (no
    pickle); read back, it is what was written."""
    f = io.BytesIO()
    faults = wire.Faults(die_after_bytes=5, corrupt=frozenset({1}))
    wire.write_setup(f, 4321, b"\x01" * 32, PAYLOADS, QUANTUM, faults)
    raw = f.getvalue()
    n = wire._SETUP.unpack(raw[:wire._SETUP.size])[0]
    head = json.loads(raw[wire._SETUP.size:wire._SETUP.size + n])
    assert head["sizes"] == {"a": [1024, 1024]} and raw[wire._SETUP.size + n:] == b"".join(PAYLOADS["a"])
    f.seek(0)
    assert wire.read_setup(f) == dict(port=4321, token=b"\x01" * 32, payloads=PAYLOADS, names=("a",),
                                      quantum=QUANTUM, faults=faults)


if __name__ == "__main__":      # the sender double, started by a Wire in place of the real sender
    _rogue(sys.argv[1])
