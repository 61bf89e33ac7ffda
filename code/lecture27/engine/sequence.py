"""What the engine works on: a request as the API hands it over (`Request`), the request inside the engine
(`Sequence`: where it is, its cache, its answer so far, how its next token's logits are shaped) and a run of tokens
to compute behind a cache, a piece per step (`Prefill`: a prompt, a chunk prefilled alone, a store job, kv_check's
full prefill, the prompt scored for echo)."""
from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Callable

import torch

from lecture27 import kvstore as ks
from lecture27.engine.chat import Prompt
from lecture27.engine.blocks import SeqCache

ROOM_TOKENS = 256     # answer tokens a request's cache holds room for from the start


def kv_need(bytes_per_token: int, prompt: int, max_tokens: int, *, held: bool = True, check: bool = False) -> int:
    """The most KV memory (bytes) a request can hold while it runs: its own cache, the prompt and every answer token
    (SeqCache never grows past them); beside it, while it is prefilled or blended, the KV the store gave it (`held`:
    a prefix block, the blend path's chunks, at most a prompt's worth); kv_check's or echo's full prefill (`check`:
    another prompt's worth). The scheduler admits a request while the running ones' needs and its own fit the
    budget; the API refuses one whose need, every part counted, exceeds the whole budget."""
    return bytes_per_token * (prompt + max_tokens + 1 + prompt * held + prompt * check)


@dataclass
class Request:
    """One completion: the prompt, how to decode, and where its events go. emit(kind, **data) is called from the
    model thread: "start" (after the prefill: reuse, queue_s, prefill_s), "prompt" (after "start", when
    echo_logprobs is asked: scores, a Scored or None for each prompt token), "text" (delta, token, scored: a Scored
    when logprobs is asked), "end" (finish_reason, tokens, kl), "error" (message).

    Decoding follows OpenAI's definitions: logit_bias is added to the logits, then every token the answer holds
    already loses presence_penalty once and frequency_penalty for each time it was chosen; the token is the argmax at
    temperature 0, else drawn from softmax(logits / temperature) within the top_p nucleus, with `seed`'s generator."""
    prompt: Prompt
    emit: Callable
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict = field(default_factory=dict)   # {token id: added to its logit}
    seed: int | None = None
    stop: tuple = ()
    logprobs: int | None = None       # each answer token's logprob and this many alternatives (None: not asked)
    echo_logprobs: int | None = None  # each prompt token's too (a completion's echo): a full prefill scores them
    kv_check: bool = False     # also prefill in full and report the first token's KL (what reuse cost)
    ignore_eos: bool = False   # an end-of-turn token does not end the answer (vLLM's field, for benchmarks)
    cancelled: threading.Event = field(default_factory=threading.Event)
    queued_at: float = field(default_factory=time.perf_counter)


@dataclass(frozen=True)
class Scored:
    """A token's log-probability under the logits it was picked from (or, for a prompt token, the logits before
    it), and the `top` most likely tokens there: ((token, logprob), ...), most likely first."""
    token: int
    logprob: float
    top: tuple = ()


def scored(logprobs: torch.Tensor, token: int, top: int) -> Scored:
    """logprobs: log_softmax of one position's logits (vocab,)."""
    best = logprobs.topk(top) if top else None
    return Scored(token, float(logprobs[token]),
                  tuple(zip(best.indices.tolist(), best.values.tolist())) if best is not None else ())


def pick(logits: torch.Tensor, temperature: float, gen: torch.Generator, top_p: float = 1.0) -> int:
    """The argmax at temperature 0; else a draw from softmax(logits / temperature), within the nucleus: the most
    likely tokens whose probabilities sum to top_p (at least the most likely one)."""
    if temperature <= 0:
        return int(logits.argmax())
    probs = (logits.float() / temperature).softmax(-1)
    if top_p >= 1:
        return int(torch.multinomial(probs, 1, generator=gen))
    p, ids = probs.sort(descending=True)
    keep = int((p.cumsum(0) - p < top_p).sum().clamp(min=1))   # the tokens before which less than top_p is summed
    return int(ids[int(torch.multinomial(p[:keep], 1, generator=gen))])


class Status(Enum):
    """Where a request is in the engine. Only the scheduler changes it (scheduler.py: add, admit, then what a
    step's post-processing reports: prefilled, decoded, finished, drop)."""
    LOADING = auto()      # the loader fetches its KV from the store
    WAITING = auto()      # loaded, not admitted (first come, first served)
    PREFILLING = auto()   # its parts run: the prompt after the held prefix, or the blend path's system message and
    #                       the chunks no tier held
    BLENDING = auto()     # CacheBlend's pass is due
    DECODING = auto()     # a token a step
    CHECKING = auto()     # answered; its kv_check (or echo) prefill still runs
    DONE = auto()         # ended: answered, cancelled or failed; its KV let go


class Kind(Enum):
    """What a prefill unit computes, and so what its last piece leads to (Engine.done)."""
    PROMPT = auto()   # a request's own prompt: its last logits are the first answer token's
    SYSTEM = auto()   # the blend path's system message, which its chunks are prefilled behind
    CHUNK = auto()    # a chunk no tier held, prefilled alone behind the system message (then saved)
    CHECK = auto()    # kv_check's full prefill: its last logits against the served ones
    ECHO = auto()     # a full prefill that also scores every prompt token (a completion's echo with logprobs)
    STORE = auto()    # a chunk prefilled alone to be stored (a store job, owned by the scheduler)


@dataclass(eq=False)
class Prefill:
    """Tokens to run behind a cache, a piece per step (chunked prefill); `kind` says what for (Kind). key: the
    chunk saved when it ends, its rows from `skip` on."""
    kind: Kind
    todo: list
    cache: SeqCache
    owner: "Sequence | None" = None
    key: ks.ChunkKey | None = None
    skip: int = 0
    index: int = -1            # the blend path's chunk index of a CHUNK
    scores: list = field(default_factory=list)   # ECHO: a Scored for each prompt token scored so far (None first)
    last: torch.Tensor | None = None             # ECHO: the logits after the tokens run so far

    @property
    def logits(self) -> bool:
        """Its last piece's last logits are read (the first answer token's, or kv_check's)."""
        return self.kind in (Kind.PROMPT, Kind.CHECK)

    @property
    def every(self) -> bool:
        """Every token's logits are read (echo scores each prompt token)."""
        return self.kind is Kind.ECHO

    def score(self, piece: list, logits: torch.Tensor, top: int) -> None:
        """An ECHO piece ran: logits (len(piece), vocab), every token's. Each token is scored by the logits before it
        (the prompt's first by none: None)."""
        before = logits[:-1] if self.last is None else torch.cat([self.last[None], logits[:-1]])
        if self.last is None:
            self.scores.append(None)
            piece = piece[1:]
        self.scores += [scored(lp, t, top) for lp, t in zip(before.log_softmax(-1), piece)]
        self.last = logits[-1]


class Sequence:
    """A request inside the engine: its status (Status, changed by the scheduler alone), what the store gave it
    (`loaded`), its cache, the prefill units still to run, its answer so far and how its next token is picked."""

    def __init__(self, req: Request, cfg):
        self.req, self.prompt, self.cfg = req, req.prompt, cfg
        self.status, self.loaded, self.cache = Status.LOADING, None, None
        self.parts: list[Prefill] = []       # what must run before the first token (PREFILLING)
        self.check: Prefill | None = None    # kv_check's full prefill
        self.blocks: list = []               # the blend path: the system message's block and each earlier message's
        self.alone: dict = {}                # {message index: block} chunks prefilled alone here (saved after)
        self.out, self.sent, self.finish, self.next_token = [], "", None, None
        self.served_logits, self.check_logits = None, None   # the logits served, and a full prefill's (kv_check)
        self.started, self.prompt_scores = False, None   # "start" emitted; echo's scores, until emitted after it
        self.admitted_at = None
        self.counts: dict = {}               # {token: times the answer holds it} (the penalties)
        self.bias = (torch.tensor(list(req.logit_bias), dtype=torch.long),
                     torch.tensor(list(req.logit_bias.values()), dtype=torch.float32)) if req.logit_bias else None
        self.gen = torch.Generator().manual_seed(req.seed if req.seed is not None else random.getrandbits(63))

    def release(self) -> None:
        """Let go of its KV the moment it ends: its prefill units point back at it (Prefill.owner), a cycle that only
        Python's garbage collector would break, and it runs too seldom for caches of megabytes; until then an ended
        request's cache would stay in memory beside the ones the budget admitted."""
        self.cache, self.parts, self.check, self.blocks, self.alone, self.loaded = None, [], None, [], {}, None

    @property
    def kv_bytes(self) -> int:
        """kv_need of this request, once loaded: what the store gave it is held beside its cache only when it gave
        something (float32 caches)."""
        held = self.loaded is not None and (self.loaded.prefix is not None or self.loaded.path == "blend")
        return kv_need(self.cfg.kv_bytes_per_token(4), len(self.prompt), self.req.max_tokens, held=held,
                       check=self.req.kv_check or self.req.echo_logprobs is not None)

    @property
    def limit(self) -> int:
        """The most tokens its cache holds: the prompt and every answer token."""
        return len(self.prompt) + self.req.max_tokens + 1

    @property
    def room(self) -> int:
        """Tokens a prompt's cache makes room for beyond the prompt: the answer's, up to ROOM_TOKENS (a longer
        answer grows the cache as it goes)."""
        return min(self.req.max_tokens, ROOM_TOKENS) + 1

    def plan(self) -> None:
        """Its prefill units, from what the connector loaded (on admission): the prompt after the held prefix; on
        the blend path the system message first, when no tier held it, else the chunks no tier held (none: the
        blend pass is due at once); and kv_check's or echo's full prefill."""
        loaded, tokens, extra = self.loaded, self.prompt.tokens, self.room
        self.admitted_at = time.perf_counter()
        if self.req.echo_logprobs is not None:
            self.check = Prefill(Kind.ECHO, list(tokens), SeqCache.empty(self.cfg, len(tokens)), owner=self)
        elif self.req.kv_check:
            self.check = Prefill(Kind.CHECK, list(tokens), SeqCache.empty(self.cfg, len(tokens)), owner=self)
        if loaded.path != "blend":
            cache = SeqCache(loaded.prefix, len(tokens) - loaded.covered + extra) if loaded.prefix is not None \
                else SeqCache.empty(self.cfg, len(tokens) + extra)
            cache.limit = self.limit
            self.parts = [Prefill(Kind.PROMPT, list(tokens[loaded.covered:]), cache, owner=self)]
            return
        system = self.prompt.system
        if system and loaded.system is None:   # the system message first: the chunks are computed behind it
            self.parts = [Prefill(Kind.SYSTEM, list(system), SeqCache.empty(self.cfg, len(system)), owner=self)]
        else:
            self.chunk_parts(loaded.system)

    def chunk_parts(self, system_block) -> None:
        """The blend path, once the system message's KV is at hand: every chunk that no tier held is prefilled alone
        behind it (none: CacheBlend's pass is due)."""
        self.blocks = [system_block] if self.prompt.system else []
        self.parts = []
        for i, (chunk, block) in enumerate(zip(self.prompt.chunks, self.loaded.chunks)):
            if block is None:
                cache = SeqCache(system_block, len(chunk)) if system_block is not None else \
                    SeqCache.empty(self.cfg, len(chunk))
                self.parts.append(Prefill(Kind.CHUNK, list(chunk), cache, owner=self, skip=len(self.prompt.system),
                                          index=i))

    def units(self) -> list:
        """This request's prefill work that may run this step, in order."""
        return self.parts if self.status is Status.PREFILLING else []

    def shaped(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits the next token is picked from (Request's docstring): logit_bias added, then OpenAI's
        penalties over the answer's tokens so far, logits[t] -= presence * [count > 0] + frequency * count."""
        req = self.req
        penalised = self.counts and (req.presence_penalty or req.frequency_penalty)
        if self.bias is None and not penalised:
            return logits
        logits = logits.clone()
        if self.bias is not None:
            logits[self.bias[0]] += self.bias[1]
        if penalised:
            ids = torch.tensor(list(self.counts), dtype=torch.long)
            counts = torch.tensor(list(self.counts.values()), dtype=logits.dtype)
            logits[ids] -= req.presence_penalty + req.frequency_penalty * counts
        return logits

    def chose(self, token: int) -> None:
        """The answer holds `token` once more."""
        self.out.append(token)
        self.counts[token] = self.counts.get(token, 0) + 1
