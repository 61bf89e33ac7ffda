"""A real KV chunk store (§6.3, §7): chunks' KV written to RAM and to local disk (and, with kvstore_redis.py, to
a Redis server), read back and checked. tiers.py simulates tiers from capacities and bandwidths; this one
stores the bytes, so fetching a chunk costs what this machine makes it cost.

A chunk is content-addressed as LMCache keys it (`ChunkKey`): the model that made its KV, the tokens it was
prefilled behind (a shared system prompt, at positions 0..P-1) and its own tokens. The same key names the
same KV on every tier and in every process: an engine that restarts finds its chunks again by their tokens.

A tier holds named records (bytes) with a byte budget and LRU eviction, as tiers.Tier does:
  RamTier   a dict in this process's memory;
  DiskTier  one file per chunk. A record is written to a temporary name, fsync'd, then renamed, so a writer
            killed half way leaves no half chunk under a chunk's name (its temporary file is removed later).
            The written pages are dropped from the OS page cache, so the next read comes from the disk;
            `drop_cache` does the same before a timed read and `page_cache_share` says what was measured.
  RedisTier (kvstore_redis.py) a real redis-server, the remote store engines share.
Every tier has put(name, blob) -> bool, get(name) -> bytes | None, has, discard, used, names (LRU order).

`ChunkStore(tier, fmt)` stores a chunk's KV, an array (T, L, 2, C) as common.llama.kv_to_array makes it, in
one of two formats (FORMATS): "fp16", 2 bytes a value; or "cachegen", kvcache's bitstream at one codec spec
(a level). A record is a header (magic, version, format, level, the key's digest, the shape, the payload's
length), the payload, and a CRC-32 of both. `get` returns the float32 KV, or None: a clean miss. A record
that fails its checksum, names another key, or does not decode is a miss with one line on stderr (and is
discarded, so the next put stores it again), never wrong KV. fp16 returns the FP16 values exactly; cachegen
returns kvcache.dequantize of the codec's integers, exactly what the codec decodes.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import struct
import sys
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lecture27 import kvcache as kv

FORMATS = ("fp16", "cachegen")
RECORD_MAGIC = b"L27K"
RECORD_VERSION = 1
_HEAD = struct.Struct("<4sBBB16sIHHQ")   # magic, version, format, level, key digest, T, L, C, payload bytes
_CRC = struct.Struct("<I")
TEMP_SUFFIX = ".tmp"                      # a DiskTier record being written: .<name>.<writer pid>.<random>.tmp
RECORD_SUFFIX = ".kv"


@dataclass(frozen=True)
class ChunkKey:
    """What a chunk's KV depends on: the model, the tokens it was prefilled behind, its own tokens."""
    model: str                # the model file (e.g. "SmolLM2-135M-Instruct.Q4_1.gguf:<size>")
    tokens: tuple             # the chunk's tokens
    prefix: tuple = ()        # the tokens before it when it was prefilled (positions 0..P-1)

    @functools.cached_property
    def digest(self) -> bytes:
        """16 bytes of BLAKE2b over the three: the chunk's name in every tier."""
        text = json.dumps([self.model, list(map(int, self.prefix)), list(map(int, self.tokens))])
        return hashlib.blake2b(text.encode(), digest_size=16).digest()


class Corrupt(ValueError):
    """A record that is not what its name says: a miss, never KV."""


# ------------------------------------------------------------------------------------------ records
def pack(key: ChunkKey, kvs, fmt: str, spec: kv.CodecSpec | None = None) -> bytes:
    """A chunk's record: header, payload (FP16 values in (T, L, 2, C) order, or the codec's bitstream), CRC-32."""
    X = np.asarray(kvs, np.float32)
    if X.ndim != 4 or X.shape[2] != 2:
        raise ValueError(f"a chunk's KV is (T, L, 2, C), not {X.shape}")
    if fmt == "fp16":
        payload, level = X.astype(np.float16).tobytes(), 0
    elif fmt == "cachegen":
        if spec is None or spec.shape != X.shape[1:]:
            raise ValueError("the cachegen format needs the codec spec of this model's (L, 2, C)")
        payload, level = kv.codec_encode(X, spec), spec.level
    else:
        raise ValueError(f"format {fmt!r} is not one of {', '.join(FORMATS)}")
    T, L, _, C = X.shape
    head = _HEAD.pack(RECORD_MAGIC, RECORD_VERSION, FORMATS.index(fmt), level, key.digest, T, L, C, len(payload))
    return head + payload + _CRC.pack(zlib.crc32(payload, zlib.crc32(head)))


def check(record, key: ChunkKey) -> tuple[str, tuple, memoryview]:
    """(format, shape (T, L, 2, C), payload) of a record of `key`; Corrupt if its length, checksum or key is off."""
    view = memoryview(record)
    if len(view) < _HEAD.size + _CRC.size:
        raise Corrupt("is shorter than a record")
    magic, version, fmt, _, digest, T, L, C, n = _HEAD.unpack_from(view)
    if magic != RECORD_MAGIC or version != RECORD_VERSION or fmt >= len(FORMATS):
        raise Corrupt("is not a chunk record of this version")
    if len(view) != _HEAD.size + n + _CRC.size:
        raise Corrupt(f"is {len(view)} bytes, its header announces {_HEAD.size + n + _CRC.size}")
    (crc,) = _CRC.unpack_from(view, len(view) - _CRC.size)
    if zlib.crc32(view[:-_CRC.size]) != crc:
        raise Corrupt("fails its checksum")
    if digest != key.digest:
        raise Corrupt("holds another chunk's KV")
    return FORMATS[fmt], (T, L, 2, C), view[_HEAD.size:-_CRC.size]


def unpack(fmt: str, shape: tuple, payload, spec: kv.CodecSpec | None = None) -> np.ndarray:
    """A checked record's payload -> float32 KV (T, L, 2, C)."""
    if fmt == "fp16":
        return np.frombuffer(payload, np.float16).reshape(shape).astype(np.float32)
    if spec is None:
        raise Corrupt("is a cachegen record and this store has no codec spec")
    try:
        q = kv.codec_decode(bytes(payload), spec)
    except ValueError as e:   # CorruptStream, or another spec's fingerprint
        raise Corrupt(f"does not decode ({e})") from None
    if q.shape != shape:
        raise Corrupt(f"decodes to {q.shape}, its header says {shape}")
    return kv.dequantize(q, spec)


# ------------------------------------------------------------------------------------------ the store
class ChunkStore:
    """One tier, one format: put(key, kv) and get(key) -> float32 KV or None (a miss)."""

    def __init__(self, tier, fmt: str = "fp16", spec: kv.CodecSpec | None = None, say=None):
        if fmt not in FORMATS:
            raise ValueError(f"format {fmt!r} is not one of {', '.join(FORMATS)}")
        if fmt == "cachegen" and spec is None:
            raise ValueError("the cachegen format needs a codec spec (kvcache.CodecSpec at one level)")
        self.tier, self.fmt, self.spec = tier, fmt, spec
        self.say = say or (lambda line: print(line, file=sys.stderr))
        self.misses = self.corrupt = 0

    def name(self, key: ChunkKey) -> str:
        """The record's name in the tier: the key's digest and the format (the codec's level for cachegen)."""
        return key.digest.hex() + ("-fp16" if self.fmt == "fp16" else f"-cachegen{self.spec.level}")

    def encode(self, key: ChunkKey, kvs) -> bytes:
        return pack(key, kvs, self.fmt, self.spec)

    def put(self, key: ChunkKey, kvs) -> bool:
        """Store a chunk (or make it most recently used if the tier has it). False: bigger than the tier."""
        name = self.name(key)
        return self.tier.touch(name) or self.tier.put(name, self.encode(key, kvs))

    def put_record(self, key: ChunkKey, record: bytes) -> bool:
        return self.tier.put(self.name(key), record)

    def fetch(self, key: ChunkKey):
        """The chunk's record read from the tier and checked: (format, shape, payload), or None."""
        name = self.name(key)
        record = self.tier.get(name)
        if record is None:
            self.misses += 1
            return None
        try:
            return check(record, key)
        except Corrupt as e:
            return self._bad(name, e)

    def decode(self, key: ChunkKey, fetched) -> np.ndarray | None:
        """A fetched record -> float32 KV (T, L, 2, C), or None when it does not decode."""
        try:
            return unpack(*fetched, self.spec)
        except Corrupt as e:
            return self._bad(self.name(key), e)

    def decode_many(self, keys, fetched) -> list:
        """Fetched records of several chunks -> their KV (None where one does not decode). The cachegen
        bitstreams of one stream layout are decoded together, every stream of every chunk side by side
        (kvcache.codec_decode_many), as a GPU decodes a request's chunks. Layouts are kept apart because the
        coder steps as long as the longest stream it holds: a short chunk (the 3-token chat prefix) is coded as
        one long stream, and decoding it beside the others would make them all wait for it."""
        if self.fmt == "fp16":
            return [self.decode(k, f) for k, f in zip(keys, fetched)]
        datas, by_layout = [bytes(f[2]) for f in fetched], {}
        for i, data in enumerate(datas):
            try:
                layout = kv.codec_header(data)["layout"]
            except ValueError:
                layout = None
            by_layout.setdefault(layout, []).append(i)
        out = [None] * len(keys)
        for layout, idx in by_layout.items():
            try:
                qs = kv.codec_decode_many([datas[i] for i in idx], self.spec) if layout else None
            except ValueError:
                qs = None
            if qs is None:   # a bad bitstream among them: one by one, so each bad one is named and missed
                for i in idx:
                    out[i] = self.decode(keys[i], fetched[i])
                continue
            for i, q in zip(idx, qs):
                shape = fetched[i][1]
                out[i] = (kv.dequantize(q, self.spec) if q.shape == shape
                          else self._bad(self.name(keys[i]), Corrupt(f"decodes to {q.shape}, its header says {shape}")))
        return out

    def get(self, key: ChunkKey) -> np.ndarray | None:
        fetched = self.fetch(key)
        return None if fetched is None else self.decode(key, fetched)

    def get_many(self, keys) -> list:
        """get for several chunks, the cachegen ones decoded together (decode_many)."""
        fetched = [self.fetch(k) for k in keys]
        hits = [i for i, f in enumerate(fetched) if f is not None]
        out = [None] * len(keys)
        for i, X in zip(hits, self.decode_many([keys[i] for i in hits], [fetched[i] for i in hits])):
            out[i] = X
        return out

    def _bad(self, name: str, why: Corrupt):
        self.say(f"kvstore: {self.tier.name}: chunk {name} {why}: a miss (recompute it)")
        self.tier.discard(name)
        self.misses += 1
        self.corrupt += 1
        return None


# ------------------------------------------------------------------------------------------ tiers
def make_room(tier, name: str, nbytes: int) -> bool:
    """Before a put: False when the record is already there (it is touched, nothing to write) or can never
    fit the tier's budget; else the least recently used records are evicted until nbytes more fit, True."""
    if tier.touch(name) or nbytes > tier.budget:
        return False
    used = tier.used
    while used + nbytes > tier.budget:
        used -= tier.evict_oldest()
        tier.evictions += 1
    return True


class RamTier:
    """Records in this process's memory, LRU within a byte budget. get returns a copy (the read into the
    engine's buffer that the other tiers also make)."""
    name = "ram"

    def __init__(self, budget: int):
        self.budget, self.records, self.evictions = budget, OrderedDict(), 0

    @property
    def used(self) -> int:
        return sum(map(len, self.records.values()))

    def names(self) -> list:
        """Eviction order, next victim first."""
        return list(self.records)

    def has(self, name: str) -> bool:
        return name in self.records

    def touch(self, name: str) -> bool:
        if name in self.records:
            self.records.move_to_end(name)
            return True
        return False

    def put(self, name: str, blob: bytes) -> bool:
        if not make_room(self, name, len(blob)):
            return self.has(name)
        self.records[name] = bytes(blob)
        return True

    def evict_oldest(self) -> int:
        return len(self.records.popitem(last=False)[1])

    def get(self, name: str):
        return bytearray(self.records[name]) if self.touch(name) else None

    def discard(self, name: str) -> None:
        self.records.pop(name, None)

    def drop_cache(self, name: str) -> None:
        """Nothing to drop: RAM is the medium."""


class DiskTier:
    """One file per record in `folder`, LRU within a byte budget. The LRU order is the files' mtimes (a read
    touches its file), so a second process that opens the folder sees the same order; each process keeps
    the budget over the files it knows of (a file another process removed is forgotten when it is missed)."""
    name = "disk"

    def __init__(self, folder, budget: int):
        self.folder, self.budget, self.evictions = Path(folder), budget, 0
        self.folder.mkdir(parents=True, exist_ok=True)
        self._tick = 0
        self.removed_temp = remove_dead_writers(self.folder)
        files = []
        for p in self.folder.glob("*" + RECORD_SUFFIX):
            try:
                st = p.stat()
            except FileNotFoundError:
                continue
            files.append((st.st_mtime_ns, p.name[:-len(RECORD_SUFFIX)], st.st_size))
        self.sizes = OrderedDict((name, size) for _, name, size in sorted(files))

    def path(self, name: str) -> Path:
        return self.folder / (name + RECORD_SUFFIX)

    @property
    def used(self) -> int:
        return sum(self.sizes.values())

    def names(self) -> list:
        return list(self.sizes)

    def has(self, name: str) -> bool:
        return self.path(name).exists()

    def evict_oldest(self) -> int:
        victim, size = self.sizes.popitem(last=False)
        self.path(victim).unlink(missing_ok=True)
        return size

    def touch(self, name: str) -> bool:
        self._tick = max(time.time_ns(), self._tick + 1)   # strictly increasing: the order survives a rescan
        try:
            os.utime(self.path(name), ns=(self._tick, self._tick))
            size = self.path(name).stat().st_size
        except FileNotFoundError:
            self.sizes.pop(name, None)
            return False
        self.sizes[name] = size
        self.sizes.move_to_end(name)
        return True

    def put(self, name: str, blob: bytes) -> bool:
        if not make_room(self, name, len(blob)):
            return self.has(name)
        write_atomic(self.path(name), blob)
        self.sizes[name] = len(blob)
        self.touch(name)
        return True

    def get(self, name: str):
        try:
            with open(self.path(name), "rb", buffering=0) as f:
                data = f.read()
        except FileNotFoundError:
            self.sizes.pop(name, None)
            return None
        self.touch(name)
        return data

    def discard(self, name: str) -> None:
        self.path(name).unlink(missing_ok=True)
        self.sizes.pop(name, None)

    def drop_cache(self, name: str) -> None:
        drop_cache(self.path(name))


def write_atomic(path: Path, blob) -> None:
    """Write to a temporary name in the same folder, fsync, drop its pages from the page cache, rename over
    `path`, fsync the folder: a reader sees the whole record or none, even if this process is killed."""
    tmp = path.parent / f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}{TEMP_SUFFIX}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        view = memoryview(blob)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
        _fadvise_dontneed(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.replace(tmp, path)
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def remove_dead_writers(folder: Path) -> int:
    """Remove the temporary files of writers that are no longer running (killed mid-write). Returns how many."""
    n = 0
    for p in folder.glob("." + "*" + TEMP_SUFFIX):
        parts = p.name.split(".")
        pid = int(parts[-3]) if len(parts) >= 4 and parts[-3].isdigit() else None
        if pid is None or not pid_alive(pid):
            p.unlink(missing_ok=True)
            n += 1
    return n


def pid_alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True   # no /proc (not Linux): kill(pid, 0) succeeded
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _fadvise_dontneed(fd: int) -> bool:
    if not hasattr(os, "posix_fadvise"):
        return False
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    return True


def drop_cache(path) -> bool:
    """Drop a file's pages from the OS page cache (fsync, then POSIX_FADV_DONTNEED), so the next read comes
    from the disk. False where the OS offers no posix_fadvise (the read may then come from the cache)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        return _fadvise_dontneed(fd)
    finally:
        os.close(fd)


def page_cache_share(path) -> float | None:
    """Share of a file's pages in the OS page cache now (mincore(2) on a mapping of it), None where unknown:
    what a timed read of it will measure, the disk (0) or the cache (1)."""
    import ctypes
    import mmap
    size = os.path.getsize(path)
    if size == 0:
        return 0.0
    try:
        mincore = ctypes.CDLL(None, use_errno=True).mincore
    except (OSError, AttributeError):
        return None
    page = mmap.PAGESIZE
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as mm:
        buf = (ctypes.c_char * size).from_buffer(mm)
        vec = (ctypes.c_ubyte * (-(-size // page)))()
        ok = mincore(ctypes.c_void_p(ctypes.addressof(buf)), ctypes.c_size_t(size), vec) == 0
        del buf
    return float(np.frombuffer(vec, np.uint8).__and__(1).mean()) if ok else None
