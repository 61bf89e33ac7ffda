"""A stored chunk's record (§6.3, §7): the bytes a tier of the chunk store (kvstore.py) holds for one chunk's KV.

A chunk's KV is an array (T, L, 2, C) as common.llama.kv_to_array makes it, in one of two formats (FORMATS):
"fp16", 2 bytes a value; or "cachegen", kvcache's bitstream at one codec spec (a level). A record is a header
(magic, version, format, level, the chunk key's digest, the shape, the payload's length), the payload, and a
CRC-32 of both. `check` reads a record back and raises Corrupt when its length, checksum or key is off, so a
damaged record is a miss, never wrong KV; `unpack` turns a checked payload into float32 KV: fp16 gives the FP16
values exactly, cachegen kvcache.dequantize of the codec's integers, exactly what the codec decodes.
"""
from __future__ import annotations

import struct
import zlib

import numpy as np

from lecture27 import kvcache as kv

FORMATS = ("fp16", "cachegen")
RECORD_MAGIC = b"L27K"
RECORD_VERSION = 1
HEAD = struct.Struct("<4sBBB16sIHHQ")   # magic, version, format, level, key digest, T, L, C, payload bytes
CRC = struct.Struct("<I")


class Corrupt(ValueError):
    """A record that is not what its name says: a miss, never KV."""


def check_format(fmt: str) -> None:
    """ValueError unless `fmt` is one of FORMATS."""
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r} is not one of {', '.join(FORMATS)}")


def pack(digest: bytes, kvs, fmt: str, spec: kv.CodecSpec | None = None) -> bytes:
    """A chunk's record, under its key's 16-byte digest: header, payload (FP16 values in (T, L, 2, C) order, or
    the codec's bitstream), CRC-32."""
    X = np.asarray(kvs, np.float32)
    if X.ndim != 4 or X.shape[2] != 2:
        raise ValueError(f"a chunk's KV is (T, L, 2, C), not {X.shape}")
    check_format(fmt)
    if fmt == "fp16":
        payload, level = X.astype(np.float16).tobytes(), 0
    else:
        if spec is None or spec.shape != X.shape[1:]:
            raise ValueError("the cachegen format needs the codec spec of this model's (L, 2, C)")
        payload, level = kv.codec_encode(X, spec), spec.level
    T, L, _, C = X.shape
    head = HEAD.pack(RECORD_MAGIC, RECORD_VERSION, FORMATS.index(fmt), level, digest, T, L, C, len(payload))
    return head + payload + CRC.pack(zlib.crc32(payload, zlib.crc32(head)))


def check(record, digest: bytes) -> tuple[str, tuple, memoryview]:
    """(format, shape (T, L, 2, C), payload) of a record of the key with this digest; Corrupt if its length,
    checksum or key is off."""
    view = memoryview(record)
    if len(view) < HEAD.size + CRC.size:
        raise Corrupt("is shorter than a record")
    magic, version, fmt, _, got, T, L, C, n = HEAD.unpack_from(view)
    if magic != RECORD_MAGIC or version != RECORD_VERSION or fmt >= len(FORMATS):
        raise Corrupt("is not a chunk record of this version")
    if len(view) != HEAD.size + n + CRC.size:
        raise Corrupt(f"is {len(view)} bytes, its header announces {HEAD.size + n + CRC.size}")
    (crc,) = CRC.unpack_from(view, len(view) - CRC.size)
    if zlib.crc32(view[:-CRC.size]) != crc:
        raise Corrupt("fails its checksum")
    if got != digest:
        raise Corrupt("holds another chunk's KV")
    return FORMATS[fmt], (T, L, 2, C), view[HEAD.size:-CRC.size]


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
    return dequantized(q, shape, spec)


def dequantized(q: np.ndarray, shape: tuple, spec: kv.CodecSpec) -> np.ndarray:
    """The codec's decoded integers -> float32 KV; Corrupt when they are not the shape the header says."""
    if q.shape != shape:
        raise Corrupt(f"decodes to {q.shape}, its header says {shape}")
    return kv.dequantize(q, spec)
