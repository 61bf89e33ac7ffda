"""The scheduler: which work runs in the next step (continuous batching with chunked prefill, as vLLM and
nano-vllm schedule).

A step has a budget of STEP_TOKENS tokens. Every running request in its decode phase puts in one token, so a long
prompt never stops the others' answers; a request whose CacheBlend pass is due puts in the tokens it recomputes
(one pass a step); the prompts being prefilled take pieces of what is left, oldest request first; the store's
jobs (a chunk prefilled alone to be stored) take the rest, and at least STORE_JOB_TOKENS whenever one waits, so
under steady traffic a document seen once is reusable within a few steps. A new request is admitted at the next
step while fewer than `max_running` run (1: one request at a time, as an engine without batching serves) and the
running requests' KV and its own fit `kv_budget` bytes (sequence.kv_need: each counted at the most it can hold, so
the caches never outgrow the budget); the oldest waits at the head of the queue until they do, and nothing behind
it goes first. A request alone always runs: the API refuses one that could not fit even alone (HTTP 400).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from lecture27.engine.runner import blend_cost
from lecture27.engine.sequence import Prefill, Sequence

STEP_TOKENS = 256     # a step's tokens: SmolLM2 on two cores computes about this many in 0.5-0.7 s
STORE_JOB_TOKENS = 32  # a step's tokens kept for the store jobs while one waits
MAX_RUNNING = 16      # requests admitted at once (decoding, prefilling)
KV_GB = 2.0           # the running requests' KV caches, at most (serve.py --kv-gb)


@dataclass
class Batch:
    """A step's work: the requests that decode a token, the one whose CacheBlend pass runs, the prefill pieces
    [(unit, tokens)]."""
    decode: list = field(default_factory=list)
    blend: Sequence | None = None
    pieces: list = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.decode or self.blend or self.pieces)


class Scheduler:
    def __init__(self, step_tokens: int = STEP_TOKENS, store_job_tokens: int = STORE_JOB_TOKENS,
                 max_running: int = MAX_RUNNING, ratio: float = 0.15, kv_budget: int = int(KV_GB * 1e9)):
        self.step_tokens, self.store_job_tokens = step_tokens, store_job_tokens
        self.max_running, self.ratio, self.kv_budget = max_running, ratio, kv_budget
        self.waiting: deque = deque()    # loaded, not admitted (first come, first served)
        self.running: list = []          # admitted and not done, in arrival order
        self.store_jobs: deque = deque()   # Prefill units of kind "store"

    def add(self, seq: Sequence) -> None:
        seq.phase = "wait"
        self.waiting.append(seq)

    def add_store_job(self, job: Prefill) -> None:
        self.store_jobs.append(job)

    def cancelled(self) -> list:
        """The requests whose client went away, waiting or running: they leave the queues (the engine ends them)."""
        gone = [s for s in [*self.waiting, *self.running] if s.req.cancelled.is_set()]
        for seq in gone:
            self.drop(seq)
        return gone

    def drop(self, seq: Sequence) -> None:
        """A request that ended (or was cancelled): its work leaves the queues, and its KV is let go."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.release()

    def kv_used(self) -> int:
        """Bytes of KV the running requests may hold (sequence.kv_need)."""
        return sum(seq.kv_bytes for seq in self.running)

    def idle(self) -> bool:
        return not (self.waiting or self.running or self.store_jobs)

    def admit(self) -> list:
        """The waiting requests that join the running ones now (the engine plans their prefill)."""
        admitted = []
        while self.waiting and len(self.running) < self.max_running and \
                (not self.running or self.kv_used() + self.waiting[0].kv_bytes <= self.kv_budget):
            seq = self.waiting.popleft()
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    def batch(self) -> Batch:
        """The step's work (module docstring)."""
        b, budget = Batch(), self.step_tokens
        b.decode = [s for s in self.running if s.phase == "decode"]
        budget -= len(b.decode)
        b.blend = next((s for s in self.running if s.phase == "blend"), None)
        if b.blend is not None:
            p = b.blend.prompt
            budget -= blend_cost(self.ratio, len(p) - len(p.question), len(p.question))
        reserve = self.store_job_tokens if self.store_jobs else 0
        units = [u for s in self.running for u in s.units()] + [s.check for s in self.running
                                                                if s.check is not None and s.check.todo]
        for unit in units:
            n = min(len(unit.todo), budget - reserve)
            if n <= 0:
                break
            b.pieces.append((unit, n))
            budget -= n
        for job in self.store_jobs:
            n = min(len(job.todo), budget)
            if n <= 0:
                break
            b.pieces.append((job, n))
            budget -= n
        return b
