"""A stored chunk's record (§6.3, §7): the bytes a tier of the chunk store (kvstore.py) holds for one chunk's KV.

A chunk's KV is an array (T, L, 2, C) as common.llama.kv_to_array makes it, in one of two formats (FORMATS):
"fp16", 2 bytes a value; or "cachegen", kvcache's bitstream at one codec spec (a level). A record is a header
(magic, version, format, level, the chunk key's digest, the shape, the payload's length), the payload, an
optional signature, and a CRC-32 of all before it.

A record is read by people other than its writer (a shared Redis, a shared disk), so `check` trusts nothing
in it before it has been checked against the rest: its length against its header, its checksum, its key, its
shape against the chunk (T = the chunk's tokens; (L, 2, C) = the codec's), the FP16 payload's length against
T·L·2·C·2 and a bitstream's own header against T, L and C, all before anything is allocated from them. A
record that fails is Corrupt: a miss, never wrong KV and never an exception past the store. `unpack` turns a
checked payload into float32 KV: fp16 gives the FP16 values exactly, cachegen kvcache.dequantize of the
codec's integers, exactly what the codec decodes.

The checksum finds damage, not intent: anyone who can write to a shared store can write a record whose
checksum is right. A store that others can write to is protected by a signature: with a key (SIGNING_ENV,
an environment variable, never a flag: a command line is readable by everyone on the machine), each record
carries an HMAC-SHA256 of its header and payload, and a record without one, or with another, is a miss.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import struct
import zlib

import numpy as np

from lecture27 import kvcache as kv

FORMATS = ("fp16", "cachegen")
RECORD_MAGIC = b"L27K"
RECORD_VERSION = 1
HEAD = struct.Struct("<4sBBB16sIHHQ")   # magic, version, format, level, key digest, T, L, C, payload bytes
CRC = struct.Struct("<I")
SIGNED = 0x80                           # in the format byte: an HMAC-SHA256 follows the payload
SIGNATURE_BYTES = 32
SIGNING_ENV = "L27_KV_SIGNING_KEY"      # the key that signs and checks records (unset: records are not signed)


def signing_key() -> bytes | None:
    """The records' signing key, from the environment (SIGNING_ENV), or None."""
    key = os.environ.get(SIGNING_ENV)
    return key.encode() if key else None


class Corrupt(ValueError):
    """A record that is not what its name says: a miss, never KV."""


def check_format(fmt: str) -> None:
    """ValueError unless `fmt` is one of FORMATS."""
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r} is not one of {', '.join(FORMATS)}")


def pack(digest: bytes, kvs, fmt: str, spec: kv.CodecSpec | None = None, key: bytes | None = None,
         layout: str | None = None) -> bytes:
    """A chunk's record, under its key's 16-byte digest: header, payload (FP16 values in (T, L, 2, C) order, or
    the codec's bitstream, in `layout` or the codec's own choice), the HMAC-SHA256 of both under `key` (when
    given), CRC-32."""
    X = np.asarray(kvs, np.float32)
    if X.ndim != 4 or X.shape[2] != 2:
        raise ValueError(f"a chunk's KV is (T, L, 2, C), not {X.shape}")
    check_format(fmt)
    if fmt == "fp16":   # the values' bytes as they are cast, not copied again: a writer copies them once, below
        payload, level = memoryview(X.astype(np.float16, order="C")).cast("B"), 0
    else:
        if spec is None or spec.shape != X.shape[1:]:
            raise ValueError("the cachegen format needs the codec spec of this model's (L, 2, C)")
        payload, level = kv.codec_encode(X, spec, layout), spec.level
    T, L, _, C = X.shape
    kind = FORMATS.index(fmt) | (SIGNED if key else 0)
    parts = [HEAD.pack(RECORD_MAGIC, RECORD_VERSION, kind, level, digest, T, L, C, len(payload)), payload]
    if key:
        mac = hmac.new(key, parts[0], hashlib.sha256)
        mac.update(payload)
        parts.append(mac.digest())
    crc = 0
    for part in parts:   # zlib and hashlib let go of the GIL on long buffers; one join copies the record once
        crc = zlib.crc32(part, crc)
    return b"".join([*parts, CRC.pack(crc)])


def check(record, digest: bytes, tokens: int | None = None, shape: tuple | None = None,
          key: bytes | None = None) -> tuple[str, tuple, memoryview]:
    """(format, shape (T, L, 2, C), payload) of a record of the key with this digest; Corrupt unless its length,
    checksum, key and signature (with `key`: signed by it) are right and its shape is the chunk's: T = `tokens`
    (the chunk's token count), (L, 2, C) = `shape` when given, and the payload as long as that shape needs."""
    view = memoryview(record)
    if len(view) < HEAD.size + CRC.size:
        raise Corrupt("is shorter than a record")
    magic, version, kind, _, got, T, L, C, n = HEAD.unpack_from(view)
    fmt, signed = kind & ~SIGNED, bool(kind & SIGNED)
    if magic != RECORD_MAGIC or version != RECORD_VERSION or fmt >= len(FORMATS):
        raise Corrupt("is not a chunk record of this version")
    announced = HEAD.size + n + SIGNATURE_BYTES * signed + CRC.size
    if len(view) != announced:
        raise Corrupt(f"is {len(view)} bytes, its header announces {announced}")
    (crc,) = CRC.unpack_from(view, len(view) - CRC.size)
    if zlib.crc32(view[:-CRC.size]) != crc:
        raise Corrupt("fails its checksum")
    if got != digest:
        raise Corrupt("holds another chunk's KV")
    if key is not None:
        body = view[:HEAD.size + n]
        if not signed or not hmac.compare_digest(hmac.new(key, body, hashlib.sha256).digest(),
                                                 bytes(view[HEAD.size + n:HEAD.size + n + SIGNATURE_BYTES])):
            raise Corrupt("is not signed with this store's key")
    if tokens is not None and T != tokens:
        raise Corrupt(f"holds {T} tokens' KV, the chunk has {tokens}")
    if shape is not None and (L, 2, C) != tuple(shape):
        raise Corrupt(f"holds KV of shape (L, 2, C) = ({L}, 2, {C}), not {tuple(shape)}")
    payload = view[HEAD.size:HEAD.size + n]
    if FORMATS[fmt] == "fp16" and n != T * L * 2 * C * 2:
        raise Corrupt(f"holds {n} bytes of FP16, its shape needs {T * L * 2 * C * 2}")
    if FORMATS[fmt] == "cachegen":
        try:
            h = kv.codec_header(bytes(payload[:kv.CODEC_HEADER_BYTES]), lengths=False)
        except ValueError as e:
            raise Corrupt(f"holds no bitstream ({e})") from None
        if h["tokens"] != T:
            raise Corrupt(f"holds a bitstream of {h['tokens']} tokens, its header says {T}")
    return FORMATS[fmt], (T, L, 2, C), payload


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
