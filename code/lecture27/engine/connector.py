"""The KV connector: LMCache's role inside the engine (§6: the KV cache lives in a library outside the engine,
one that outlives it and that engines share; §5.1 and §5.3: reuse that is not only a prefix).

Where KV is kept (`Tiers`): RAM, then local disk, then Redis (kvstore.py's tiers, one FP16 record per chunk,
checked on every read). A read tries each tier in turn and copies a hit into the tiers above it; a write goes
to every tier (each keeps what fits, least recently used out first), so a second engine on the same Redis finds
what the first one stored.

What is kept, keyed by content (kvstore.ChunkKey: the model, the tokens before, the tokens):
  prefix blocks   the prompt (and the answer after it) cut into BLOCK_TOKENS-token blocks, each keyed by every
                  token before it (vLLM's and LMCache's prefix keys): exact KV, reused only behind the same tokens;
  message chunks  in a chat, every message after the system message, prefilled alone behind it (kvstore's
                  chunk_keys): reusable wherever the message comes back, in any order, beside any messages.
How a prompt is served (`KVConnector.prefill`), whichever reuses more:
  prefix   the longest run of stored prefix blocks is the cache, exactly; the rest is prefilled behind it
           (a chat's next turn pays only for its new tokens, up to one block);
  blend    the system message's KV, then every earlier message's chunk (fetched, or prefilled alone behind the
           system message if the store has none), each shifted to its place (kvstore.assemble), and CacheBlend
           (blend_world.blend at the rule and ratio 04 measured) recomputes a few tokens per layer while the
           last message is computed in full;
  prefill  nothing stored: a full prefill.
After the answer (`KVConnector.to_store`) the request's exact KV is cut into prefix blocks and its messages into
chunks; what needs the model (a message prefilled alone) is left for when the engine has no request waiting.
Blended KV is never stored: a store hands out only KV a full prefill would compute.
"""
from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, field

import numpy as np
import torch

from common.llama import KVCache, array_to_kv, kl_divergence, kv_to_array
from lecture27 import blend_rules
from lecture27 import blend_world as bw
from lecture27 import kvstore as ks
from lecture27.engine.chat import Prompt

BLOCK_TOKENS = 32     # a prefix block (vLLM's default block is 16 tokens, LMCache's chunk 256): at most this many
                      # tokens of a chat's history are prefilled again on its next turn
PIECE_TOKENS = 64     # a message prefilled alone to be stored runs this many tokens at a time (prefill_pieces)


class Tiers:
    """LMCache's storage hierarchy: ChunkStores of FP16 records, fastest first (RAM, disk, Redis). Safe to call
    from the engine's model thread and its storing thread at once (one lock)."""

    def __init__(self, tiers: list, shape: tuple):
        self.stores = [ks.ChunkStore(t, "fp16", shape=shape) for t in tiers]
        self.lock = threading.Lock()

    @property
    def names(self) -> list:
        return [s.tier.name for s in self.stores]

    def get(self, key: ks.ChunkKey) -> tuple[np.ndarray | None, str | None]:
        """(the chunk's KV, the tier it came from), or (None, None); a hit below the top is copied upwards."""
        with self.lock:
            for i, store in enumerate(self.stores):
                X = store.get(key)
                if X is not None:
                    if i:
                        self._put(key, X, self.stores[:i])
                    return X, store.tier.name
        return None, None

    def has(self, key: ks.ChunkKey) -> bool:
        with self.lock:
            return any(s.tier.has(s.name(key)) for s in self.stores)

    def put(self, key: ks.ChunkKey, X) -> None:
        """Write a chunk through to every tier. X: its KV, or a function that makes it, called only when a tier
        lacks the record (an exact repeat's blocks are all held: each is touched, none converted or coded)."""
        if callable(X):
            with self.lock:
                if all(s.tier.touch(s.name(key)) for s in self.stores):
                    return
            X = X()             # outside the lock: the model thread reads the tiers meanwhile
        with self.lock:
            self._put(key, X, self.stores)

    def _put(self, key, X, stores) -> None:
        lacking = [s for s in stores if not s.tier.touch(s.name(key))]
        if lacking:
            record = lacking[0].encode(key, X)   # one format, one signing key: the same bytes for every tier
            for s in lacking:
                s.put_record(key, record)


@dataclass
class Reuse:
    """How a prompt was served: its tokens whose KV came from the store exactly (prefix) or as reused chunks
    (blended), and those computed here (recomputed); the records read from each tier."""
    path: str = "prefill"     # "prefix", "blend" or "prefill"
    prefix: int = 0
    blended: int = 0
    recomputed: int = 0
    hits: dict = field(default_factory=dict)
    context: int = 0          # tokens before the last message (a chat's system message and earlier messages): reusable

    @property
    def cached(self) -> int:
        return self.prefix + self.blended

    def header(self) -> str:
        """The response header's text: the split of the prompt's tokens."""
        return (f"path={self.path}; prefix={self.prefix}; blended={self.blended}; recomputed={self.recomputed}; "
                f"context={self.context}")


@dataclass
class Prefilled:
    """A prompt's prefill: the next token's logits (vocab,), the prompt's KV, how it was served, how many of
    its first rows are exact (worth storing as prefix blocks) and the chunks prefilled alone here (to store)."""
    logits: torch.Tensor
    cache: KVCache
    reuse: Reuse
    exact: int
    alone: dict = field(default_factory=dict)   # {chunk index: KV (T, L, 2, C)}


def block_keys(model_id: str, tokens, block: int = BLOCK_TOKENS) -> list:
    """(start, end, key) of each block of `tokens` (the last one may be shorter), keyed by all tokens before it."""
    tokens = tuple(tokens)
    return [(a, min(a + block, len(tokens)), ks.ChunkKey(model_id, tokens[a:a + block], tokens[:a]))
            for a in range(0, len(tokens), block)]


def message_keys(model_id: str, prompt: Prompt) -> list:
    """The keys of a chat's message chunks (every message after the system message, the last one included),
    each prefilled alone behind the system message."""
    return [ks.ChunkKey(model_id, tuple(c), tuple(prompt.system)) for c in (*prompt.chunks, prompt.last_message) if c]


class KVConnector:
    """The engine's side of the store (module docstring). tiers: a Tiers, or None (no store: every prompt is
    prefilled in full). blend: reuse message chunks out of order with CacheBlend at `ratio` with `rule`."""

    def __init__(self, model, model_id: str, tiers: Tiers | None, *, blend: bool = True, ratio: float = 0.15,
                 rule: str = "query", block: int = BLOCK_TOKENS):
        self.model, self.model_id, self.tiers = model, model_id, tiers
        self.blend, self.ratio, self.rule, self.block = blend, ratio, blend_rules.ALL_RULES[rule], block

    # ------------------------------------------------------------------------------------------------ reading
    def stored_prefix(self, tokens: list) -> tuple[list, int, dict]:
        """The stored prefix blocks of `tokens`, as far as they go, leaving at least the last token to compute
        (its logits are the first answer token's): (their KV arrays, the tokens they cover, hits per tier)."""
        arrays, covered, hits = [], 0, {}
        for a, b, key in block_keys(self.model_id, tokens, self.block):
            if a >= len(tokens) - 1:
                break
            X, tier = self.tiers.get(key)
            if X is None:
                break
            arrays.append(X[:min(b, len(tokens) - 1) - a])
            covered, hits[tier] = a + len(arrays[-1]), hits.get(tier, 0) + 1
        return arrays, covered, hits

    @torch.no_grad()
    def prefill(self, prompt: Prompt) -> Prefilled:
        done = self.served(prompt)
        done.reuse.context = len(prompt) - len(prompt.question)
        return done

    def served(self, prompt: Prompt) -> Prefilled:
        tokens = prompt.tokens
        if self.tiers is None:
            return self.prefill_behind(tokens, [], Reuse())
        arrays, covered, hits = self.stored_prefix(tokens)
        if self.blend and prompt.chunks:
            keys = message_keys(self.model_id, prompt)[:len(prompt.chunks)]
            held = [self.tiers.has(k) for k in keys]
            if len(prompt.system) + sum(len(c) for c, h in zip(prompt.chunks, held) if h) >= covered + self.block:
                return self.blend_chunks(prompt, keys, held, arrays, covered)
        reuse = Reuse(path="prefix" if covered else "prefill", prefix=covered, hits=hits)
        return self.prefill_behind(tokens, arrays, reuse)

    def prefill_behind(self, tokens: list, arrays: list, reuse: Reuse) -> Prefilled:
        """Prefill tokens[covered:] behind the stored prefix blocks (exact: the KV a full prefill computes)."""
        covered = sum(map(len, arrays))
        cache = array_to_kv(np.concatenate(arrays), self.model.cfg.n_kv_heads) if arrays else None
        logits, cache = self.model(torch.tensor([tokens[covered:]]), cache=cache, last=True)
        reuse.recomputed = len(tokens) - covered
        return Prefilled(logits[0, -1], cache, reuse, exact=len(tokens))

    def blend_chunks(self, prompt: Prompt, keys: list, held: list, arrays: list, covered: int) -> Prefilled:
        """CacheBlend over the chat's messages (module docstring): the system message's KV from the stored
        prefix (or its own record, or prefilled), each earlier message's chunk fetched or prefilled alone behind
        it, placed, blended; the last message computed in full at every layer."""
        model, S = self.model, len(prompt.system)
        reuse = Reuse(path="blend", hits={})
        system = self.system_kv(prompt, arrays, covered, reuse)
        chunks, alone = [], {}
        for i, (key, chunk) in enumerate(zip(keys, prompt.chunks)):
            X, tier = self.tiers.get(key) if held[i] else (None, None)
            if X is None:   # not stored (or gone since has()): prefilled alone behind the system message, as stored
                X = alone[i] = ks.chunk_kvs(model, prompt.system, [chunk], pre=system)[-1]
                reuse.recomputed += len(chunk)
            else:
                reuse.blended += len(chunk)
                reuse.hits[tier] = reuse.hits.get(tier, 0) + 1
            chunks.append(X)
        all_keys = ks.chunk_keys(self.model_id, prompt.system, prompt.chunks)
        pre = ks.assemble(all_keys, ([kv_to_array(system)[0]] if S else []) + chunks, model.cfg)
        ids = [bw.PREFIX] * S + [i for i, c in enumerate(prompt.chunks) for _ in c]
        doc = bw.RagDoc(torch.tensor([[*prompt.system, *(t for c in prompt.chunks for t in c)]]),
                        torch.tensor([prompt.question]), torch.tensor(ids), rag=None)
        rule = self.rule.ready(model, doc, doc.chunks, pre)
        logits, trace = bw.blend(model, doc, doc.chunks, self.ratio, rule=rule, pre=pre, trace=True)
        reuse.recomputed += len(prompt.question)
        return Prefilled(logits[0, -1], trace.cache, reuse, exact=S, alone=alone)

    def system_kv(self, prompt: Prompt, arrays: list, covered: int, reuse: Reuse) -> KVCache | None:
        """The system message's exact KV: from the stored prefix blocks, its own record, or prefilled here."""
        S = len(prompt.system)
        if not S:
            return None
        if covered >= S:
            reuse.prefix = S
            return array_to_kv(np.concatenate(arrays)[:S], self.model.cfg.n_kv_heads)
        X, tier = self.tiers.get(ks.ChunkKey(self.model_id, tuple(prompt.system)))
        if X is not None:
            reuse.prefix, reuse.hits[tier] = S, reuse.hits.get(tier, 0) + 1
            return array_to_kv(X, self.model.cfg.n_kv_heads)
        reuse.recomputed += S
        return self.model(torch.tensor([list(prompt.system)]), last=True)[1]

    @torch.no_grad()
    def first_token_kl(self, prompt: Prompt, served: torch.Tensor) -> float:
        """KL(full prefill || served) of the first answer token's distribution, in nats: what reuse cost."""
        full = self.model(torch.tensor([prompt.tokens]), last=True)[0][0, -1]
        return float(kl_divergence(full.log_softmax(-1), served.log_softmax(-1)))

    # ------------------------------------------------------------------------------------------------ writing
    def to_store(self, prompt: Prompt, done: Prefilled, cache: KVCache, sequence: list) -> tuple[list, list]:
        """What a served request leaves in the store: ([(key, KV or a function that makes it) to put now],
        [(key, chunk) to prefill alone behind the system message first, when the model is idle]). sequence: the
        prompt and the answer's tokens whose KV `cache` holds (every answer token but the last)."""
        if self.tiers is None:
            return [], []
        exact = len(sequence) if done.reuse.path != "blend" else done.exact
        whole = functools.cache(lambda: kv_to_array(KVCache(cache.k, cache.v, cache.pos))[0])

        def rows(a: int, b: int):     # the cache's rows a..b, converted (once) only when a tier lacks a record
            return lambda: whole()[a:b]
        now, later = [], []
        ends = {len(prompt), len(sequence)}   # where a block shorter than BLOCK_TOKENS is kept: an exact repeat's end
        for a, b, key in block_keys(self.model_id, sequence[:exact], self.block):
            if b - a == self.block:
                now.append((key, rows(a, b)))
        for end in sorted(e for e in ends if e <= exact and e % self.block):
            a = end - end % self.block
            now.append((ks.ChunkKey(self.model_id, tuple(sequence[a:end]), tuple(sequence[:a])), rows(a, end)))
        S = len(prompt.system)
        if S and exact >= S:
            now.append((ks.ChunkKey(self.model_id, tuple(prompt.system)), rows(0, S)))
        if self.blend and prompt.last_message:
            for i, (key, chunk) in enumerate(zip(message_keys(self.model_id, prompt),
                                                 (*prompt.chunks, prompt.last_message))):
                if i in done.alone:
                    now.append((key, done.alone[i]))
                elif i == 0 and exact >= S + len(chunk):   # the first message stands where it was stored
                    now.append((key, rows(S, S + len(chunk))))
                else:
                    later.append((key, chunk))
        return now, [(k, c) for k, c in later if not self.tiers.has(k)]

    def prefill_alone(self, system: tuple, chunk: tuple) -> np.ndarray:
        """A message's KV prefilled alone behind the system message: its chunk record."""
        *_, X = self.prefill_pieces(system, chunk)
        return X

    @torch.no_grad()
    def prefill_pieces(self, system: tuple, chunk: tuple, piece: int = PIECE_TOKENS):
        """prefill_alone `piece` tokens at a time, each piece after the cache of those before it (a chunked
        prefill: the same KV up to float32 rounding): yields None after each piece but the last, then the chunk
        record. Between two pieces the engine serves a request that came (generate.py): a store job never makes a
        request wait longer than a piece."""
        S = len(system)
        cache = self.model(torch.tensor([list(system)]), last=True)[1] if S else None
        for a in range(0, len(chunk), piece):
            _, cache = self.model(torch.tensor([list(chunk[a:a + piece])]), cache=cache, last=True)
            if a + piece < len(chunk):
                yield None
        yield kv_to_array(KVCache([k[:, :, S:] for k in cache.k], [v[:, :, S:] for v in cache.v]))[0]
