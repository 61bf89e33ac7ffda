"""KV you can trust: a record read from a store that others write to is believed only once it has been checked
against the chunk it names, so a wrong model, a forged shape, a record of fewer tokens than its chunk, a bitstream
that announces more tokens than its bytes carry, an unsigned record in a signed store, a full disk or a failed
cleanup step is a miss (or a False put) with one line, never wrong KV, an exception out of the store, or
something left behind."""
import os
import stat
import subprocess
import sys
import textwrap
import tracemalloc

import numpy as np
import pytest

from lecture27 import kvcache as kv
from lecture27 import kvrecord
from lecture27 import kvstore as ks


def small_spec(L=4, C=64, seed=0):
    """A codec fitted on random KV of (L, 2, C): enough to code and decode, quick to fit."""
    X = np.random.default_rng(seed).normal(size=(2, 20, L, 2, C)).astype(np.float32)
    return kv.fit_codec(X, np.full((L, 2), 0.5, np.float32), True), X


def store(tmp_path, fmt="fp16", spec=None, key=b"", said=None):
    """A chunk store on disk; `said` collects its lines."""
    lines = said if said is not None else []
    return ks.ChunkStore(ks.DiskTier(tmp_path / "disk", 1 << 30), fmt, spec, say=lines.append, key=key,
                         shape=(4, 2, 64))


def chunk(T=4, L=4, C=64, seed=1):
    return np.random.default_rng(seed).normal(size=(T, L, 2, C)).astype(np.float32)


def test_two_files_of_one_name_and_size_are_two_models(tmp_path):
    a, b = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf"
    for p, byte in ((a, b"\x01"), (b, b"\x02")):
        p.parent.mkdir()
        p.write_bytes(byte * 4096)
    assert a.stat().st_size == b.stat().st_size and a.name == b.name
    ida, idb = ks.model_id(a), ks.model_id(b)
    assert ida != idb and f"kv{ks.KV_LAYOUT}" in ida
    s = store(tmp_path)
    s.put(ks.ChunkKey(ida, (1, 2, 3, 4)), chunk())
    assert s.get(ks.ChunkKey(idb, (1, 2, 3, 4))) is None          # model b is never served model a's KV
    assert s.get(ks.ChunkKey(ida, (1, 2, 3, 4))) is not None


def forged(record: bytes, **fields) -> bytes:
    """`record` with header fields replaced and its checksum made right again: what a writer can plant."""
    names = ("magic", "version", "kind", "level", "digest", "T", "L", "C", "n")
    head = dict(zip(names, kvrecord.HEAD.unpack_from(record)))
    head.update(fields)
    body = kvrecord.HEAD.pack(*(head[k] for k in names)) + record[kvrecord.HEAD.size:-kvrecord.CRC.size]
    import zlib
    return body + kvrecord.CRC.pack(zlib.crc32(body))


@pytest.mark.parametrize("fields", [{"T": 8}, {"L": 2, "C": 128}, {"T": 2, "C": 128}])
def test_a_header_whose_shape_disagrees_with_its_payload_is_a_miss(tmp_path, fields):
    said = []
    s, key = store(tmp_path, said=said), ks.ChunkKey("m", (1, 2, 3, 4))
    s.put_record(key, forged(s.encode(key, chunk()), **fields))
    assert s.get(key) is None and s.corrupt == 1                    # not a ValueError out of get
    assert len(said) == 1 and "a miss" in said[0]


@pytest.mark.parametrize("fmt", ["fp16", "cachegen"])
def test_a_record_of_fewer_tokens_than_its_chunk_is_a_miss(tmp_path, fmt):
    """A record whose header and payload agree (its length, checksum, key digest and (L, 2, C) all right) but
    hold 2 tokens' KV, stored under a 4-token chunk's name: the chunk's own token count decides, so it is a miss
    with one line, never 2 tokens' KV served as the chunk's."""
    spec = small_spec()[0] if fmt == "cachegen" else None
    said = []
    s, key = store(tmp_path, fmt, spec, said=said), ks.ChunkKey("m", (1, 2, 3, 4))
    short = s.encode(key, chunk(T=2))
    assert kvrecord.check(short, key.digest, 2, (4, 2, 64))[1] == (2, 4, 2, 64)     # a good record of 2 tokens
    s.put_record(key, short)
    assert s.get(key) is None and s.corrupt == 1
    assert len(said) == 1 and "holds 2 tokens' KV, the chunk has 4" in said[0]
    s.put_record(key, short)
    assert s.get_many([key]) == [None] and s.corrupt == 2


def bomb(spec, T=65_535) -> bytes:
    """A CacheGen bitstream of a few KB whose header announces T tokens: every group empty."""
    groups = -(-T // spec.group)
    head = kv._CODEC_HEADER.pack(kv.CODEC_MAGIC, kv.CODEC_VERSION, spec.level, int(spec.delta), spec.group, T,
                                 spec.fingerprint)
    return head + bytes(groups)


@pytest.mark.parametrize("record_tokens", [65_535, 4])
def test_a_bitstream_announcing_65535_tokens_is_a_miss_without_allocating(tmp_path, record_tokens):
    spec, _ = small_spec()
    said = []
    s, key = store(tmp_path, "cachegen", spec, said=said), ks.ChunkKey("m", (1, 2, 3, 4))
    good = s.encode(key, chunk())
    payload = bomb(spec)
    planted = forged(good[:kvrecord.HEAD.size] + payload + bytes(kvrecord.CRC.size), T=record_tokens,
                     n=len(payload))
    assert len(planted) < 8_000
    s.put_record(key, planted)
    tracemalloc.start()
    try:
        got = s.get(key)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert got is None and len(said) == 1
    assert peak < 16 << 20          # the decoder's array would be 65,535 x 4 x 2 x 64 x 8 B = 268 MB


def test_the_decoder_believes_a_token_count_only_as_far_as_the_bytes_carry_it():
    spec, _ = small_spec()
    with pytest.raises(ValueError, match="announces 65535 tokens"):
        kv.codec_header(bomb(spec)[:2_000])


def test_a_signed_store_misses_unsigned_and_foreign_records(tmp_path, monkeypatch):
    key, X = ks.ChunkKey("m", (1, 2, 3, 4)), chunk()
    monkeypatch.setenv(kvrecord.SIGNING_ENV, "our key")
    ours = ks.ChunkStore(ks.DiskTier(tmp_path / "disk", 1 << 30), say=lambda line: None)
    assert ours.key == b"our key"                                    # from the environment, never a flag
    unsigned = ks.ChunkStore(ours.tier, key=b"", say=lambda line: None)
    theirs = ks.ChunkStore(ours.tier, key=b"their key", say=lambda line: None)
    for writer, hit in ((unsigned, False), (theirs, False), (ours, True)):
        ours.tier.discard(ours.name(key))
        writer.put(key, X)
        got = ours.get(key)
        assert (got is not None) == hit
    assert np.array_equal(got, X.astype(np.float16).astype(np.float32))
    assert unsigned.get(key) is not None                             # a store with no key reads it too
    assert len(ours.encode(key, X)) == len(unsigned.encode(key, X)) + kvrecord.SIGNATURE_BYTES


def test_disk_records_are_the_owners_alone(tmp_path):
    tier = ks.DiskTier(tmp_path / "store", 1 << 20)
    tier.put("a", b"x" * 100)
    assert stat.S_IMODE((tmp_path / "store").stat().st_mode) == 0o700
    assert stat.S_IMODE(tier.path("a").stat().st_mode) == 0o600


@pytest.mark.slow
def test_a_full_disk_is_a_false_put_with_one_line(tmp_path):
    """RLIMIT_FSIZE stands for a full disk: a write past it fails (EFBIG, SIGXFSZ ignored)."""
    script = textwrap.dedent("""
        import resource, signal, sys
        from lecture27 import kvstore as ks
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        tier = ks.DiskTier(sys.argv[1], 1 << 30)
        resource.setrlimit(resource.RLIMIT_FSIZE, (10_000, 10_000))
        print(tier.put("big", b"x" * 50_000), tier.put("big2", b"x" * 50_000), tier.put("small", b"x" * 100))
        print(tier.used, tier.names())
    """)
    run = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split("\n")[:2] == ["False False True", "100 ['small']"]
    assert run.stderr.count("kvstore: disk tier") == 1                # one line, the first time
    assert sorted(p.name for p in tmp_path.iterdir()) == ["small.kv"]  # no temporary file left


def test_cleanup_runs_every_step_when_one_fails(tmp_path):
    from lecture27.store import machine
    done = []

    class Tier:
        def clear(self):
            done.append("clear")
            raise ConnectionError("the server went away")

        def close(self):
            done.append("close")

    class Server:
        def stop(self):
            done.append("stop")

    folder = tmp_path / "kvstore-x"
    folder.mkdir()
    with pytest.raises(ConnectionError):
        machine.close_tiers({"redis": Tier()}, Server(), folder)
    assert done == ["clear", "close", "stop"] and not folder.exists()


def test_no_record_is_unpickled(tmp_path):
    """A store's bytes are parsed as a record, never loaded with pickle (which runs what the bytes say)."""
    import pickle
    s, key = store(tmp_path), ks.ChunkKey("m", (1, 2, 3, 4))

    class Boom:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "ran"),))
    s.put_record(key, pickle.dumps(Boom()))
    assert s.get(key) is None and not (tmp_path / "ran").exists()
