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

The scheduler is a request's state machine (sequence.Status), as nano-vllm's is: a request's status changes here
and nowhere else. add: LOADING -> WAITING; admit: -> PREFILLING (or BLENDING, when the store held every chunk);
then what a step's post-processing reports: prefilled (the blend path's last chunk computed: -> BLENDING), decoded
(a token sent: -> DECODING), finished (the answer ended: -> CHECKING while kv_check's prefill runs, else DONE),
drop (-> DONE: ended, cancelled, failed). It also owns the store jobs, the queue of chunks to prefill alone.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from lecture27.engine.blocks import blend_cost
from lecture27.engine.sequence import Prefill, Sequence, Status

STEP_TOKENS = 256     # a step's tokens: SmolLM2 on two cores computes about this many in 0.5-0.7 s
STORE_JOB_TOKENS = 32  # a step's tokens kept for the store jobs while one waits
MAX_RUNNING = 16      # requests admitted at once (decoding, prefilling)
KV_GB = 2.0           # the running requests' KV caches, at most (serve.py --kv-gb)
MAX_STORE_JOBS = 256  # store jobs waiting at most; past that a message is not stored alone


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
        self.store_jobs: deque = deque()   # Prefill units of kind STORE, oldest first

    # ------------------------------------------------------------------------------------------------ status
    def add(self, seq: Sequence) -> None:
        """A request the loader has loaded: it waits for admission."""
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def prefilled(self, seq: Sequence) -> None:
        """One of a request's prefill parts ended (the blend path's system message or a chunk): with none left,
        CacheBlend's pass is due."""
        if not seq.parts:
            seq.status = Status.BLENDING

    @staticmethod
    def decoded(seq: Sequence, token: int) -> None:
        """A token was sent and the answer goes on: the token is the next step's input."""
        seq.next_token, seq.status = token, Status.DECODING

    def finished(self, seq: Sequence) -> bool:
        """The answer ended. True: the request ends now (the engine reports it, then drops it); False: its
        kv_check or echo prefill still runs, and its end waits for it (CHECKING)."""
        if seq.check is not None and seq.check.todo:
            seq.status = Status.CHECKING
            return False
        return True

    def drop(self, seq: Sequence) -> None:
        """A request that ended (answered, cancelled, failed): it leaves the queues, and its KV is let go."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = Status.DONE
        seq.release()

    # ------------------------------------------------------------------------------------------------ store jobs
    def wants_store_job(self, key) -> bool:
        """Whether a chunk under `key` may become a store job: none for it waits, and the queue has room."""
        return len(self.store_jobs) < MAX_STORE_JOBS and all(j.key != key for j in self.store_jobs)

    def add_store_job(self, job: Prefill) -> None:
        self.store_jobs.append(job)

    def store_job_done(self, job: Prefill) -> None:
        self.store_jobs.remove(job)

    def drop_store_jobs(self) -> None:
        """Every waiting store job goes (the server stops; or a step failed, and a job that failed would fail every
        step after it)."""
        self.store_jobs.clear()

    def cancelled(self) -> list:
        """The requests whose client went away, waiting or running: they leave the queues (the engine ends them)."""
        gone = [s for s in [*self.waiting, *self.running] if s.req.cancelled.is_set()]
        for seq in gone:
            self.drop(seq)
        return gone

    def kv_used(self) -> int:
        """Bytes of KV the running requests may hold (sequence.kv_need)."""
        return sum(seq.kv_bytes for seq in self.running)

    def idle(self) -> bool:
        return not (self.waiting or self.running or self.store_jobs)

    def admit(self) -> list:
        """The waiting requests that join the running ones now, their prefill planned (Sequence.plan)."""
        admitted = []
        while self.waiting and len(self.running) < self.max_running and \
                (not self.running or self.kv_used() + self.waiting[0].kv_bytes <= self.kv_budget):
            seq = self.waiting.popleft()
            seq.plan()
            seq.status = Status.PREFILLING if seq.parts else Status.BLENDING
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    def batch(self) -> Batch:
        """The step's work (module docstring)."""
        b, budget = Batch(), self.step_tokens
        b.decode = [s for s in self.running if s.status is Status.DECODING]
        budget -= len(b.decode)
        b.blend = next((s for s in self.running if s.status is Status.BLENDING), None)
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
