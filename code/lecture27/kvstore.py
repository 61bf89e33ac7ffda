"""A real KV chunk store (§6.3, §7): chunks' KV written to RAM and to local disk (and, with kvstore_redis.py, to
a Redis server), read back and checked. tiers.py simulates tiers from capacities and bandwidths; this one
stores the bytes, so fetching a chunk costs what this machine makes it cost.

A chunk is content-addressed as LMCache keys it (`ChunkKey`): the model that made its KV (`model_id`), the
tokens it was prefilled behind (a shared system prompt, at positions 0..P-1) and its own tokens. The same key
names the same KV on every tier and in every process: an engine that restarts finds its chunks again by their
tokens. A request's chunks are served LMCache's way: `chunk_keys` names them, `chunk_kvs` computes each one's
KV alone behind the prefix (what a store holds does not depend on where a request puts it), and `assemble`
places the fetched chunks one after another, each chunk's K moved to its place by shift_kv.

A tier (`Tier`) holds named records (bytes) with a byte budget and LRU eviction, as tiers.SimTier does:
  RamTier   a dict in this process's memory;
  DiskTier  one file per chunk, written whole or not at all (common.files.write_atomic: a writer killed half
            way leaves no half chunk under a chunk's name, and its temporary file is removed later). The
            written pages are dropped from the OS page cache, so the next read comes from the disk;
            `drop_cache` does the same before a timed read and common.files.page_cache_share says what was
            measured.
  RedisTier (kvstore_redis.py) a real redis-server, the remote store engines share.

`ChunkStore(tier, fmt)` stores a chunk's KV as a record (kvrecord.py: header, payload in one of
kvrecord.FORMATS, checksum). `get` returns the float32 KV, or None: a clean miss. A record that fails its
checksum, names another key, or does not decode is a miss with one line on stderr (and is discarded, so the
next put stores it again), never wrong KV.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from common.files import drop_cache, remove_dead_writers, write_atomic
from common.gguf_llama import file_id
from common.llama import KVCache, LlamaConfig, array_to_kv, kv_to_array, place_chunks
from lecture27 import kvcache as kv
from lecture27 import kvrecord
from lecture27.kvrecord import Corrupt

RECORD_SUFFIX = ".kv"   # a DiskTier record's file: <name>.kv
KV_LAYOUT = 1           # the version of a chunk's KV as keyed: (T, L, 2, C) after RoPE, prefilled behind its prefix


@dataclass(frozen=True)
class ChunkKey:
    """What a chunk's KV depends on: the model, the tokens it was prefilled behind, its own tokens."""
    model: str                # the model (model_id: "SmolLM2-135M-Instruct.Q4_1.gguf:<sha256>:kv1")
    tokens: tuple             # the chunk's tokens
    prefix: tuple = ()        # the tokens before it when it was prefilled (positions 0..P-1)

    @functools.cached_property
    def digest(self) -> bytes:
        """16 bytes of BLAKE2b over the three: the chunk's name in every tier."""
        text = json.dumps([self.model, list(map(int, self.prefix)), list(map(int, self.tokens))])
        return hashlib.blake2b(text.encode(), digest_size=16).digest()


def kv_shape(cfg: LlamaConfig) -> tuple:
    """(L, 2, C) of a token's KV in this model: what each of its chunks' records holds per token."""
    return cfg.n_layers, 2, cfg.n_kv_heads * cfg.head_dim


def model_id(path) -> str:
    """The model as a chunk key names it: what its file holds (the sha256 of its bytes, as the GGUF cache keys
    it: two files of one name and size are two models) and KV_LAYOUT, the version of how its KV is laid out."""
    st = Path(path).stat()
    return _model_id(str(Path(path).resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _model_id(path: str, size: int, mtime_ns: int) -> str:   # the file hashed once per version of it
    f = file_id(Path(path))
    return f"{f['file']}:{f['sha256'][:32]}:kv{KV_LAYOUT}"


# ------------------------------------------------------------------------------------------ a request's chunks
def chunk_keys(model: str, prefix, chunks) -> list:
    """The keys of a context: the prefix's (when there is one), then each chunk's, prefilled behind the prefix."""
    prefix = tuple(prefix)
    return ([ChunkKey(model, prefix)] if prefix else []) + [ChunkKey(model, tuple(c), prefix) for c in chunks]


@torch.no_grad()
def chunk_kvs(model, prefix, chunks, pre: KVCache | None = None) -> list:
    """The KV (T, L, 2, C) of the prefix (when there is one), then of each chunk prefilled alone behind it at
    positions P..P+c-1, chunk_keys' order. Not yet moved to a request's positions: assemble does that.
    pre: the prefix's cache, when it is at hand (it is not prefilled again)."""
    P = len(prefix)
    out = []
    if P:
        pre = pre if pre is not None else model(torch.tensor([list(prefix)]), last=True)[1]
        out.append(kv_to_array(pre)[0])
    for c in chunks:
        _, cache = model(torch.tensor([list(c)]), cache=pre, last=True)
        out.append(kv_to_array(KVCache([k[:, :, P:] for k in cache.k], [v[:, :, P:] for v in cache.v]))[0])
    return out


def assemble(keys, arrays, cfg: LlamaConfig) -> KVCache:
    """The context's cache from its chunks' fetched KV, in the keys' order: each record placed after the one
    before, its K moved from where it was prefilled (behind its prefix, at P) to its place by shift_kv (V
    carries no position); a record already at its place (the prefix, the first chunk) is not rotated."""
    stored = [array_to_kv(X, cfg.n_kv_heads, torch.arange(len(key.prefix), len(key.prefix) + len(X)))
              for key, X in zip(keys, arrays)]
    return place_chunks(stored, cfg.rope_theta)


# ------------------------------------------------------------------------------------------ the tier interface
@runtime_checkable
class Tier(Protocol):
    """Named records (bytes) within a byte budget, least recently used evicted first: what ChunkStore stores in."""
    name: str
    budget: int

    @property
    def used(self) -> int:
        """Bytes of the records held."""

    @property
    def evictions(self) -> int:
        """Records evicted to make room so far."""

    def names(self) -> list:
        """The records' names in eviction order, next victim first."""

    def has(self, name: str) -> bool:
        """Whether the record is held (without making it more recent)."""

    def touch(self, name: str) -> bool:
        """Make the record the most recently used; False when it is not held."""

    def put(self, name: str, blob: bytes) -> bool:
        """Store a record, evicting the least recently used ones to make room; False: bigger than the budget."""

    def get(self, name: str):
        """The record's bytes (and it becomes the most recently used), or None."""

    def discard(self, name: str) -> None:
        """Remove the record if it is held."""

    def evict_oldest(self) -> int:
        """Remove the least recently used record; its size in bytes."""

    def drop_cache(self, name: str) -> None:
        """Before a timed read: make the next get read the record from the tier's medium, not from a cache."""


# ------------------------------------------------------------------------------------------ the store
class ChunkStore:
    """One tier, one format: put(key, kv) and get(key) -> float32 KV or None (a miss)."""

    def __init__(self, tier: Tier, fmt: str = "fp16", spec: kv.CodecSpec | None = None, say=None,
                 key: bytes | None = None, shape: tuple | None = None, gbps: float | None = None):
        """key: sign every record written and accept only records signed with it (HMAC-SHA256); by default
        kvrecord.signing_key(), from the environment, so a restarted engine signs and checks as its parent.
        shape: the model's (L, 2, C) (kv_shape), which every record must hold (the codec's, for cachegen).
        gbps: the tier's read rate (1e9 bytes/s): a cachegen record is coded in the stream layout that is read
        and decoded soonest at that rate (kvcache.stream_plan by time, each layout's decode timed once on this
        machine: layout_decode_s); None: the codec's bytes-only choice."""
        kvrecord.check_format(fmt)
        if fmt == "cachegen" and spec is None:
            raise ValueError("the cachegen format needs a codec spec (kvcache.CodecSpec at one level)")
        self.tier, self.fmt, self.spec = tier, fmt, spec
        self.shape = tuple(shape) if shape is not None else spec.shape if spec is not None else None
        self.key = (kvrecord.signing_key() if key is None else key) or None   # b"": not signed
        self.say = say or (lambda line: print(line, file=sys.stderr))
        self.misses = self.corrupt = 0
        self.gbps = gbps
        self.reads = [0, 0, 0, 0.0, 0.0]   # get_many's: records, tokens and payload bytes read, seconds reading and
                                           # seconds decoding

    def layout(self, tokens: int) -> str | None:
        """The stream layout of a cachegen record of `tokens` tokens in this store (None: the codec's own)."""
        if self.fmt != "cachegen" or self.gbps is None:
            return None
        return kv.stream_plan(self.spec, tokens, self.gbps, layout_decode_s(self.spec, tokens)).layout

    def name(self, key: ChunkKey) -> str:
        """The record's name in the tier: the key's digest and the format (the codec's level for cachegen)."""
        return key.digest.hex() + ("-fp16" if self.fmt == "fp16" else f"-cachegen{self.spec.level}")

    def encode(self, key: ChunkKey, kvs, layout: str | None = None) -> bytes:
        """The chunk's record; a cachegen one in `layout`, or this store's (ChunkStore.layout)."""
        return kvrecord.pack(key.digest, kvs, self.fmt, self.spec, self.key, layout or self.layout(len(kvs)))

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
            return kvrecord.check(record, key.digest, len(key.tokens), self.shape, self.key)
        except Corrupt as e:
            return self._bad(name, e)

    def decode(self, key: ChunkKey, fetched) -> np.ndarray | None:
        """A fetched record -> float32 KV (T, L, 2, C), or None when it does not decode."""
        try:
            return kvrecord.unpack(*fetched, self.spec)
        except ValueError as e:   # Corrupt, or a payload that passed every check and still does not fit
            return self._bad(self.name(key), e)

    def decode_many(self, keys, fetched) -> list:
        """Fetched records of several chunks -> their KV (None where one does not decode). Every cachegen
        bitstream of the request is decoded in one call, each stream of every chunk side by side
        (kvcache.codec_decode_many), as a GPU decodes a request's chunks; a short chunk (the 3-token chat prefix)
        has short streams, and makes no other wait."""
        if self.fmt == "fp16":
            return [self.decode(k, f) for k, f in zip(keys, fetched)]
        out = [None] * len(keys)
        try:
            qs = kv.codec_decode_many([bytes(f[2]) for f in fetched], self.spec)
        except (ValueError, IndexError):
            qs = None
        if qs is None:   # a bad bitstream among them: one by one, so each bad one is named and missed
            return [self.decode(k, f) for k, f in zip(keys, fetched)]
        for i, q in enumerate(qs):
            try:
                out[i] = kvrecord.dequantized(q, fetched[i][1], self.spec)
            except Corrupt as e:
                out[i] = self._bad(self.name(keys[i]), e)
        return out

    def get(self, key: ChunkKey) -> np.ndarray | None:
        fetched = self.fetch(key)
        return None if fetched is None else self.decode(key, fetched)

    def get_many(self, keys) -> list:
        """get for several chunks, the cachegen ones decoded together (decode_many); what the reads cost is added to
        self.reads (the reading and the decoding timed apart)."""
        t0 = time.perf_counter()
        fetched = [self.fetch(k) for k in keys]
        t1 = time.perf_counter()
        hits = [i for i, f in enumerate(fetched) if f is not None]
        out = [None] * len(keys)
        for i, X in zip(hits, self.decode_many([keys[i] for i in hits], [fetched[i] for i in hits])):
            out[i] = X
        r = self.reads
        r[0] += len(hits)
        r[1] += sum(fetched[i][1][0] for i in hits)
        r[2] += sum(len(fetched[i][2]) for i in hits)
        r[3] += t1 - t0
        r[4] += time.perf_counter() - t1
        return out

    def _bad(self, name: str, why: ValueError):
        self.say(f"kvstore: {self.tier.name}: chunk {name} {why}: a miss (recompute it)")
        self.tier.discard(name)
        self.misses += 1
        self.corrupt += 1
        return None


def layout_decode_s(spec: kv.CodecSpec, tokens: int) -> dict:
    """{stream layout: seconds to decode a context of `tokens` tokens coded in it} on this machine
    (kvcache.layout_decode_seconds), timed once per codec, context length and machine and then read from the
    checkpoint folder, as the codec's levels are."""
    import platform

    from common.checkpoints import cached
    if (spec.fingerprint, tokens) not in _LAYOUT_DECODE_S:   # read once per process, each chunk's put asks
        machine = {"node": platform.node(), "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()}
        _LAYOUT_DECODE_S[spec.fingerprint, tokens] = cached(
            "codec-layout-decode", {"codec": f"{spec.fingerprint:08x}", "tokens": int(tokens), **machine},
            lambda: kv.layout_decode_seconds(spec, int(tokens)), tag="codec")
    return _LAYOUT_DECODE_S[spec.fingerprint, tokens]


_LAYOUT_DECODE_S: dict = {}


# ------------------------------------------------------------------------------------------ tiers
def make_room(tier: RamTier | DiskTier, name: str, nbytes: int) -> bool:
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

    def __init__(self, folder, budget: int, say=None):
        self.folder, self.budget, self.evictions = Path(folder), budget, 0
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)   # a prompt's KV is readable as its text
        self.say, self.said = say or (lambda line: print(line, file=sys.stderr)), False   # a failed read or write
        self._tick = 0
        self.removed_temp = remove_dead_writers(self.folder)   # killed writers' temporary files
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
        """False when the record can never fit, or the disk refuses it (full, a file-size limit): one line the
        first time, and the chunk is recomputed when it is needed."""
        if not make_room(self, name, len(blob)):
            return self.has(name)
        try:
            write_atomic(self.path(name), blob)
        except OSError as e:
            self._failed("cannot write", e)
            return False
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
        except OSError as e:   # unreadable: a miss, as a missing file is
            self._failed("cannot read", e)
            return None
        self.touch(name)
        return data

    def _failed(self, what: str, e: OSError) -> None:
        if not self.said:
            self.say(f"kvstore: disk tier {self.folder}: {what} a chunk ({e.strerror or e}): a miss (recompute it)")
        self.said = True

    def discard(self, name: str) -> None:
        self.path(name).unlink(missing_ok=True)
        self.sizes.pop(name, None)

    def drop_cache(self, name: str) -> None:
        drop_cache(self.path(name))
