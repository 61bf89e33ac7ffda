"""The KV connector: LMCache's role beside the engine (§6: the KV cache lives in a library outside the engine, one
that outlives it and that engines share; §5.1 and §5.3: reuse that is not only a prefix). It never runs the model:
`lookup` says which of a prompt's tokens the store can give, `load` fetches them, `save` takes KV the engine
computed. The engine's loader thread calls lookup and load, so no read of a tier happens inside a step.

Where KV is kept:
  hot      this process's memory (`HotCache`): KV blocks the engine just computed, readable by the next step's
           lookup with no I/O, within a byte budget, least recently used out first (as vLLM's prefix cache keeps a
           finished request's blocks on the GPU);
  tiers    RAM records, local disk, Redis (`Tiers`: kvstore.py's tiers, one record per chunk, checked on every
           read), written behind by a writer thread (`Writer`) that holds no lock the model thread takes; a read
           tries each in turn, a request's chunks at once, and a hit is kept hot. A second engine on the same Redis
           finds what the first stored. RAM keeps FP16 records; the shared tiers (disk, Redis) keep them in the
           engine's serde, LMCache's remote_serde: FP16 (its "naive"), or CacheGen's bitstream (§3-§4: the codec's
           level, about a third of FP16's bytes for SmolLM2 at level 0, lossy within that level), read back by
           the parallel decoder, every stream of a request's records side by side.
What is kept, keyed by content (kvstore.ChunkKey: the model, the tokens before, the tokens):
  prefix blocks   the prompt (and the answer after it) cut into BLOCK_TOKENS-token blocks, each keyed by every
                  token before it (vLLM's and LMCache's prefix keys): exact KV, reused only behind the same tokens;
  system message  a chat's system message alone: at the prompt's start, so exact wherever it comes back;
  chunks          in a chat, every message after the system message, prefilled alone behind it (kvstore's
                  chunk_keys), and every piece of a message (or of a completion) cut by the separator (chat.py:
                  LMCache's blend_special_str): reusable wherever it comes back, in any order, beside any others.
How a prompt is served (`Lookup.path`), whichever reuses more:
  prefix   the longest run of held prefix blocks (or the system message, where it reaches further) is the cache,
           exactly; the rest is prefilled behind it;
  blend    the system message's KV and every chunk's (held, or prefilled alone behind the system message first),
           each shifted to its place, and CacheBlend recomputes a few tokens per layer while the question (the
           last message, or its text after the last separator) is computed in full;
  prefill  nothing held: a full prefill.
When a request is loaded, each of its chunks that no tier holds becomes a store job (`StoreJob`: the chunk
prefilled alone behind the system message), which the engine runs at low priority from the request's first token
on (in the same steps as its answer, so it never slows the request's own prefill); after the request
(`KVConnector.to_save`) its exact KV is cut into prefix blocks.
Blended KV is never stored: the store hands out only KV a full prefill would compute.
"""
from __future__ import annotations

import queue
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from lecture27 import blend_rules
from lecture27 import kvstore as ks
from lecture27.engine.chat import Prompt
from lecture27.engine.blocks import array_to_block, block_to_array

BLOCK_TOKENS = 32     # a prefix block (vLLM's default block is 16 tokens, LMCache's chunk 256): at most this many
                      # tokens of a chat's history are prefilled again on its next turn
HOT_GB = 1.0          # the hot cache's budget: SmolLM2's KV is 46 kB a token in float32, so about 21,000 tokens
SERDES = ("fp16", "cachegen")   # the shared tiers' record format (LMCache's remote_serde: "naive", "cachegen")
SERDE_LAYOUT = "layer"  # a CacheGen record's streams: one per (layer, K/V) of each group of tokens, 0.2% more bytes
                        # than one stream a group, and the parallel decoder reads a request's records side by side
                        # (on one core, 1,536 tokens of SmolLM2 at level 0: 2.4 s, against over a minute serially)
SERDE_SMALL = ("channel", 64)   # ... but a record of fewer tokens (a 32-token prefix block: 240 streams of 1,920
                                # symbols, which kvcache codes serially) one stream per (layer, K/V, channel): 0.1 s
                                # to encode a block instead of 2 s, for about 30% more bytes


def serde_layout(tokens: int) -> str:
    """The stream layout of a CacheGen record of `tokens` tokens in the shared tiers."""
    return SERDE_SMALL[0] if tokens < SERDE_SMALL[1] else SERDE_LAYOUT


class HotCache:
    """KV blocks (L, 2, Hkv, T, hd) by ChunkKey in this process, least recently used out first within `budget`
    bytes. Safe from the model thread and the loader at once: each call holds a lock for a dict operation, never
    for I/O."""

    def __init__(self, budget: int):
        self.budget, self.used, self.evictions = budget, 0, 0
        self.blocks: OrderedDict = OrderedDict()
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.blocks)

    def has(self, key: ks.ChunkKey) -> bool:
        return key in self.blocks

    def get(self, key: ks.ChunkKey) -> torch.Tensor | None:
        with self.lock:
            block = self.blocks.get(key)
            if block is not None:
                self.blocks.move_to_end(key)
            return block

    def put(self, key: ks.ChunkKey, block: torch.Tensor) -> bool:
        """Keep a block (or make it the most recent); False: bigger than the budget."""
        size = block.numel() * block.element_size()
        with self.lock:
            if key in self.blocks:
                self.blocks.move_to_end(key)
                return True
            if size > self.budget:
                return False
            while self.used + size > self.budget:
                _, old = self.blocks.popitem(last=False)
                self.used -= old.numel() * old.element_size()
                self.evictions += 1
            self.blocks[key] = block
            self.used += size
            return True


class Tiers:
    """LMCache's storage hierarchy below the hot cache: ChunkStores, fastest first (RAM, disk, Redis). RAM keeps
    FP16 records, the shared tiers records in `serde` (SERDES; "cachegen" needs the codec's `spec` at one level).
    Each tier has its own lock, taken by the writer and the loader, never by the model thread: a hung Redis holds
    up only Redis's reads and writes."""

    def __init__(self, tiers: list, shape: tuple, serde: str = "fp16", spec=None):
        if serde not in SERDES or (serde == "cachegen") != (spec is not None):
            raise ValueError(f"serde {serde!r}: one of {SERDES}, and a codec spec for cachegen alone")
        fmt = {t.name: "fp16" if t.name == "ram" else serde for t in tiers}
        self.stores = [ks.ChunkStore(t, fmt[t.name], spec if fmt[t.name] == "cachegen" else None, shape=shape)
                       for t in tiers]
        self.locks = [threading.Lock() for _ in tiers]
        self.serde = serde

    def stats(self) -> list:
        """[(tier, format, records held, bytes held, records read, tokens read, bytes read, seconds reading, seconds
        decoding)]: what each tier holds now and what its reads have cost (/metrics)."""
        out = []
        for store, lock in zip(self.stores, self.locks):
            with lock:
                held = (len(store.tier.names()), store.tier.used)
            out.append((store.tier.name, store.fmt, *held, *store.reads))
        return out

    @property
    def names(self) -> list:
        return [s.tier.name for s in self.stores]

    def get(self, key: ks.ChunkKey):
        """(the chunk's KV (T, L, 2, C), the tier it came from), or (None, None); a hit below the top is copied up."""
        return self.get_many([key])[0]

    def get_many(self, keys: list) -> list:
        """get for several chunks: each tier in turn reads the ones still missing, its CacheGen records decoded
        together (ChunkStore.get_many). [(KV, tier) or (None, None)] in the keys' order."""
        out, todo = [(None, None)] * len(keys), list(range(len(keys)))
        for i, (store, lock) in enumerate(zip(self.stores, self.locks)):
            if not todo:
                break
            with lock:
                got = store.get_many([keys[j] for j in todo])
            for j, X in zip(todo, got):
                if X is not None:
                    out[j] = X, store.tier.name
                    if i:
                        self.put(keys[j], X, upto=i)
            todo = [j for j, X in zip(todo, got) if X is None]
        return out

    def has(self, key: ks.ChunkKey) -> bool:
        for store, lock in zip(self.stores, self.locks):
            with lock:
                if store.tier.has(store.name(key)):
                    return True
        return False

    def put(self, key: ks.ChunkKey, X, upto: int | None = None) -> None:
        """Write a chunk to every tier (the first `upto`) that lacks it; one record's bytes serve every tier of its
        format. X: its KV (T, L, 2, C), or a function that makes it, called only when a tier lacks the record."""
        records, kvs = {}, None
        for store, lock in list(zip(self.stores, self.locks))[:upto]:
            with lock:
                if store.tier.touch(store.name(key)):
                    continue
            if store.fmt not in records:
                kvs = (X() if callable(X) else X) if kvs is None else kvs
                records[store.fmt] = store.encode(key, kvs, serde_layout(len(kvs)) if store.fmt == "cachegen" else None)
            with lock:
                store.put_record(key, records[store.fmt])

    def close(self) -> None:
        for s in self.stores:
            if hasattr(s.tier, "close"):
                s.tier.close()


class Writer:
    """Writes behind: a thread that takes (key, KV block) and writes the record to every tier. The model thread
    only puts into its queue. `pending` counts what is not written yet (/health)."""

    def __init__(self, tiers: Tiers):
        self.tiers, self.writes, self.pending = tiers, queue.Queue(), 0
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._write, name="engine-writer", daemon=True)
        self.thread.start()

    def put(self, key: ks.ChunkKey, block: torch.Tensor) -> None:
        with self.lock:
            self.pending += 1
        self.writes.put((key, block))

    def stop(self, timeout: float = 30) -> None:
        self.writes.put(None)
        self.thread.join(timeout)

    def _write(self) -> None:
        torch.set_num_threads(1)   # only the model thread runs torch on several cores (engine.py's docstring)
        while (job := self.writes.get()) is not None:
            key, block = job
            try:
                self.tiers.put(key, lambda: block_to_array(block))
            except Exception as e:   # a tier's failure is a record not written: the chunk is recomputed when needed
                print(f"engine: writing a record failed ({type(e).__name__}: {e})", file=sys.stderr)
            finally:
                with self.lock:
                    self.pending -= 1


@dataclass
class Reuse:
    """How a prompt was served: its tokens whose KV came from the store exactly (prefix) or as reused chunks
    (blended), and those computed here (recomputed); the records read from each place (hot, ram, disk, redis)."""
    path: str = "prefill"     # "prefix", "blend" or "prefill"
    prefix: int = 0
    blended: int = 0
    recomputed: int = 0
    hits: dict = field(default_factory=dict)
    context: int = 0          # tokens before the question (the system message and the chunks): reusable

    @property
    def cached(self) -> int:
        return self.prefix + self.blended

    def hit(self, where: str) -> None:
        self.hits[where] = self.hits.get(where, 0) + 1

    def header(self) -> str:
        """The response header's text: the split of the prompt's tokens."""
        return (f"path={self.path}; prefix={self.prefix}; blended={self.blended}; recomputed={self.recomputed}; "
                f"context={self.context}")


@dataclass
class Loaded:
    """What `load` fetched for a prompt: for the prefix path the held prefix (one KV block of `covered` tokens, or
    None); for blend, the system message's block and each chunk's (None where it must be computed)."""
    path: str
    reuse: Reuse
    prefix: torch.Tensor | None = None
    system: torch.Tensor | None = None
    chunks: list = field(default_factory=list)
    # StoreJobs: chunks no tier holds that this request will not compute
    store_jobs: list = field(default_factory=list)

    @property
    def covered(self) -> int:
        return 0 if self.prefix is None else self.prefix.shape[3]


@dataclass(frozen=True)
class StoreJob:
    """A chunk to prefill alone behind the system message and save (a store job): typed, not a tuple."""
    key: ks.ChunkKey

    @property
    def tokens(self) -> tuple:
        return self.key.tokens

    @property
    def system(self) -> tuple:
        return self.key.prefix


def block_keys(model_id: str, tokens, block: int = BLOCK_TOKENS) -> list:
    """(start, end, key) of each block of `tokens` (the last one may be shorter), keyed by all tokens before it."""
    tokens = tuple(tokens)
    return [(a, min(a + block, len(tokens)), ks.ChunkKey(model_id, tokens[a:a + block], tokens[:a]))
            for a in range(0, len(tokens), block)]


def system_key(model_id: str, system) -> ks.ChunkKey:
    """The key of a system message's tokens stored alone: at the prompt's start, so exact wherever they come back."""
    return ks.ChunkKey(model_id, tuple(system))


def message_keys(model_id: str, prompt: Prompt) -> list:
    """The keys of a prompt's chunks (a chat's messages after the system message and the pieces the separator cut),
    then of a chat's last message (stored for a later turn), each prefilled alone behind the system message."""
    last = [prompt.last_message] if prompt.last_message else []
    return [ks.ChunkKey(model_id, tuple(c), tuple(prompt.system)) for c in (*prompt.chunks, *last)]


class KVConnector:
    """The engine's side of the store (module docstring). tiers: a Tiers, or None (RAM, disk and Redis off: the hot
    cache alone). store=False: no store at all (every prompt prefilled in full). blend: reuse chunks out of
    order with CacheBlend at `ratio` with `rule`."""

    def __init__(self, model_id: str, tiers: Tiers | None, n_kv_heads: int, *, store: bool = True,
                 blend: bool = True, ratio: float = 0.15, rule: str = "query", block: int = BLOCK_TOKENS,
                 hot_bytes: int = int(HOT_GB * 1e9)):
        self.model_id, self.tiers, self.n_kv_heads = model_id, tiers, n_kv_heads
        self.store, self.blend, self.ratio = store, blend, ratio
        self.rule, self.block = blend_rules.ALL_RULES[rule], block
        self.hot = HotCache(hot_bytes) if store else None
        self.writer = Writer(tiers) if store and tiers is not None else None

    def close(self) -> None:
        if self.writer:
            self.writer.stop()
        if self.tiers:
            self.tiers.close()

    @property
    def pending_writes(self) -> int:
        return self.writer.pending if self.writer else 0

    # ------------------------------------------------------------------------------------------------ reading
    def held(self, key: ks.ChunkKey) -> bool:
        return self.hot.has(key) or (self.tiers is not None and self.tiers.has(key))

    def fetch(self, key: ks.ChunkKey, reuse: Reuse) -> torch.Tensor | None:
        """A chunk's KV block from the hot cache, else from the tiers (then kept hot); counted in reuse.hits."""
        block, where = self.fetch_many([key])[0]
        if block is not None:
            reuse.hit(where)
        return block

    def fetch_many(self, keys: list) -> list:
        """[(KV block, where it came from) or (None, None)] of several chunks: the hot cache's, then the tiers' at
        once (Tiers.get_many: a request's CacheGen records decoded together), kept hot. The caller counts the
        hits it uses."""
        if self.hot is None:   # no store
            return [(None, None)] * len(keys)
        out = [(block, "hot") if block is not None else (None, None) for block in map(self.hot.get, keys)]
        missing = [i for i, (block, _) in enumerate(out) if block is None]
        if missing and self.tiers is not None:
            for i, (X, tier) in zip(missing, self.tiers.get_many([keys[i] for i in missing])):
                if X is not None:
                    out[i] = array_to_block(X, self.n_kv_heads), tier
                    self.hot.put(keys[i], out[i][0])
        return out

    def lookup(self, prompt: Prompt) -> tuple[str, int, list]:
        """Which of the prompt's tokens the store can give: (path, the held prefix blocks' tokens, for each chunk
        whether it is held). The prefix leaves at least the last token to compute (its logits are
        the first answer token's)."""
        if not self.store:
            return "prefill", 0, []
        tokens, covered, S = prompt.tokens, 0, len(prompt.system)
        for a, b, key in block_keys(self.model_id, tokens, self.block):
            if a >= len(tokens) - 1 or not self.held(key):
                break
            covered = min(b, len(tokens) - 1)
        if covered < S < len(tokens) and self.held(system_key(self.model_id, prompt.system)):
            covered = S   # a system message shorter than the blocks, or ending inside one, is a prefix of its own
        held = []
        if self.blend and prompt.chunks:
            held = [self.held(k) for k in message_keys(self.model_id, prompt)[:len(prompt.chunks)]]
            if len(prompt.system) + sum(len(c) for c, h in zip(prompt.chunks, held) if h) >= covered + self.block:
                return "blend", covered, held
        return ("prefix" if covered else "prefill"), covered, held

    def load(self, prompt: Prompt) -> Loaded:
        """lookup, then fetch what it found. A record gone since lookup (evicted, corrupt) shortens the prefix, or
        leaves its chunk to be computed."""
        path, covered, held = self.lookup(prompt)
        reuse = Reuse(path=path, context=len(prompt) - len(prompt.question))
        if path == "blend":
            loaded = self._load_blend(prompt, held, reuse)
        else:
            prefix = self.prefix(prompt, covered, reuse)
            reuse.prefix = 0 if prefix is None else prefix.shape[3]
            reuse.path = "prefix" if reuse.prefix else "prefill"
            loaded = Loaded(reuse.path, reuse, prefix=prefix)
        loaded.store_jobs = self.store_jobs(prompt, loaded.path)
        return loaded

    def store_jobs(self, prompt: Prompt, path: str) -> list:
        """The prompt's chunks (and a chat's last message) that no tier holds and this request does not compute
        alone: each becomes a store job at the request's first token, so it is reusable soon after, in any order.
        The first chunk computed in place (the exact paths) is its own chunk: to_save keeps its rows."""
        if not (self.store and self.blend and (prompt.chunks or prompt.last_message)):
            return []
        keys = message_keys(self.model_id, prompt)
        skip = len(prompt.chunks) if path == "blend" else 1   # blend computes each missing chunk itself
        return [StoreJob(k) for k in keys[skip:] if not self.held(k)]

    def prefix(self, prompt: Prompt, upto: int, reuse: Reuse) -> torch.Tensor | None:
        """The KV block of the prompt's first `upto` tokens: when `upto` is the system message's length, its own chunk
        (one record); else, or when that is gone, the held prefix blocks, as far as they are still there (None:
        none)."""
        if upto and upto == len(prompt.system):
            system = self.fetch(system_key(self.model_id, prompt.system), reuse)
            if system is not None:
                return system
        spans = [(a, b, key) for a, b, key in block_keys(self.model_id, prompt.tokens, self.block) if a < upto]
        blocks = []
        for (a, b, _), (block, where) in zip(spans, self.fetch_many([key for _, _, key in spans])):
            if block is None:
                break
            reuse.hit(where)
            blocks.append(block[:, :, :, :min(b, upto) - a])
        return torch.cat(blocks, 3) if blocks else None

    def _load_blend(self, prompt: Prompt, held: list, reuse: Reuse) -> Loaded:
        S, system = len(prompt.system), None
        if S:
            system = self.prefix(prompt, S, reuse)
            system = system if system is not None and system.shape[3] == S else None
            reuse.prefix = S if system is not None else 0
        keys = [k for k, h in zip(message_keys(self.model_id, prompt), held) if h]
        got = iter(self.fetch_many(keys))
        chunks = [next(got) if h else (None, None) for h in held]
        for _, where in chunks:
            if where is not None:
                reuse.hit(where)
        chunks = [block for block, _ in chunks]
        reuse.blended = sum(len(c) for c, b in zip(prompt.chunks, chunks) if b is not None)
        return Loaded("blend", reuse, system=system, chunks=chunks)

    # ------------------------------------------------------------------------------------------------ writing
    def save(self, key: ks.ChunkKey, block: torch.Tensor) -> None:
        """KV the engine computed (exact: what a full prefill computes): hot at once (unless bigger than the hot
        cache), the tiers written behind."""
        if self.hot is not None:
            self.hot.put(key, block)
            if self.writer is not None:
                self.writer.put(key, block)

    def to_save(self, prompt: Prompt, reuse: Reuse, cache, sequence: list) -> list:
        """What a served request leaves in the store: [(key, a KV block: rows a..b of `cache`)], its exact KV (a
        blended prompt's is exact only in the system message). sequence: the tokens whose KV `cache` holds (the
        prompt and the answer's tokens but the last)."""
        if not self.store:
            return []
        exact = len(sequence) if reuse.path != "blend" else len(prompt.system)
        now = [(key, (a, b)) for a, b, key in block_keys(self.model_id, sequence[:exact], self.block)
               if b - a == self.block]
        for end in sorted({len(prompt), len(sequence)}):   # a shorter last block: an exact repeat's end
            if end <= exact and end % self.block:
                a = end - end % self.block
                now.append((ks.ChunkKey(self.model_id, tuple(sequence[a:end]), tuple(sequence[:a])), (a, end)))
        S = len(prompt.system)
        if S and exact >= S:
            now.append((system_key(self.model_id, prompt.system), (0, S)))
        first = (*prompt.chunks, prompt.last_message)[0]
        if self.blend and first and exact >= S + len(first):   # the first chunk stands where it is stored
            now.append((message_keys(self.model_id, prompt)[0], (S, S + len(first))))
        return [(k, cache.rows(a, b)) for k, (a, b) in now if not self.hot.has(k)]
