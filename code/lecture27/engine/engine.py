"""The engine: one model on this CPU serving many requests at once (continuous batching), its KV kept outside.

Three threads, three roles (nano-vllm's shape, LMCache's contract):
  loader   a request's KV is looked up and fetched by the connector (connector.py: hot cache, RAM, disk, Redis)
           before the request joins a step, so a slow tier never holds a step up;
  model    `step()`: the scheduler picks the step's work (scheduler.py), the runner runs it as one batch
           (runner.py), then each request's new token is decoded, sent, checked against its stops, and each prefill
           unit that ran its last piece leads to what its kind says (`done`); what changes a request's status is
           reported to the scheduler, which alone changes it (sequence.Status);
  writer   the connector writes each saved chunk through the tiers behind the model's back.
Only the model thread runs torch on several cores: the loader and the writer run it on one, and so should the thread
that builds the engine (serve.py's main thread loads the model on one). PyTorch's CPU kernels run on OpenMP, and GNU
OpenMP keeps a team's idle workers spinning between two parallel regions only while it manages no more threads than
the machine has cores (libgomp's manual, GOMP_SPINCOUNT: 300,000 spins, else 100). A second team, made by a thread
that once ran torch on every core, puts every worker to sleep after each region, and each of a step's hundreds of
regions then waits for one to wake (serve.py --threads 2 on two cores with the model loaded on two: a reordered RAG
request's first token 1.6-1.8 s instead of 1.2-1.6 s, a 1,500-token prompt's 5.3-5.4 s instead of 4.1-4.2 s).
A request's KV is reusable the moment it ends: its exact blocks go into the connector's hot cache in this process
at once, and the next step's lookup finds them; a message that must be prefilled alone to be stored becomes a
store job in the same steps, at low priority.

Decoding (OpenAI's sampling parameters, sequence.Request): the served logits (a full prefill's, a reused prefix's,
or on the blended path CacheBlend's) get logit_bias and the presence and frequency penalties over the answer so far;
the token is their argmax at temperature 0, else drawn within the top_p nucleus with the request's seed; until
`max_tokens`, an end-of-turn token, a stop string, or the client going away. Logprobs, when asked, are the
log_softmax of those same logits, the ones the token was picked from (temperature and top_p shape the draw, not
the reported distribution, as OpenAI and vLLM report them): on the blended path the first token's are the blended
logits'. A completion's echo with logprobs scores the prompt's tokens with one more full prefill of the prompt (an
ECHO unit, kv_check's kind of extra work, whose every token's logits the runner keeps), exact whatever path served
the answer. Each step is reported to the
request's `emit` (the API turns the events into a response or a stream).
"""
from __future__ import annotations

import queue
import sys
import threading
import time
import traceback

import torch

from common.llama import kl_divergence, torch_threads
from lecture27 import kvstore as ks
from lecture27.engine import runner
from lecture27.engine.blocks import SeqCache
from lecture27.engine.connector import KVConnector, message_keys, system_key
from lecture27.engine.runner import Item
from lecture27.engine.scheduler import KV_GB, MAX_RUNNING, STEP_TOKENS, STORE_JOB_TOKENS, Scheduler
from lecture27.engine.sequence import Kind, Prefill, Request, Sequence, Status, pick, scored


class Engine:
    """The model, loader and writer threads around one model (module docstring). end_ids: the tokens that end an
    answer (the chat format's end of turn, the model's end of text)."""

    def __init__(self, model, tok, connector: KVConnector, end_ids, threads: int = 1, *,
                 step_tokens: int = STEP_TOKENS, store_job_tokens: int = STORE_JOB_TOKENS,
                 max_running: int = MAX_RUNNING, kv_budget: int = int(KV_GB * 1e9)):
        self.model, self.tok, self.connector, self.end_ids = runner.packed(model), tok, connector, set(end_ids)
        self.threads = threads
        self.scheduler = Scheduler(step_tokens, store_job_tokens, max_running, connector.ratio, kv_budget)
        self.inbox: queue.Queue = queue.Queue()     # what other threads hand the model thread: callables
        self.loads: queue.Queue = queue.Queue()     # the loader's work: callables
        self.loading, self.lock = 0, threading.Lock()   # requests with the loader (counted for /health)
        self.steps = 0
        self.stopping = False
        self.closing: str | None = None   # end_all's message: every request from then on ends with it
        self.model_thread = threading.Thread(target=self._serve, name="engine-model", daemon=True)
        self.loader_thread = threading.Thread(target=self._load, name="engine-loader", daemon=True)

    def start(self) -> "Engine":
        self.model_thread.start()
        self.loader_thread.start()
        return self

    def stop(self) -> list[str]:
        """End the threads; requests not answered yet get an error event. Returns the names of the threads that did
        not end within 30 s each (none, unless a tier hangs)."""
        self.stopping = True
        self.inbox.put(None)
        self.loads.put(None)
        self.model_thread.join(30)
        self.loader_thread.join(30)
        self.connector.close()
        threads = [self.model_thread, self.loader_thread, *([self.connector.writer.thread] if self.connector.writer
                                                            else [])]
        return [t.name for t in threads if t.is_alive()]

    def end_all(self, message: str) -> None:
        """The server is stopping (a signal): every request, running, waiting or still to come, ends at the next step
        with an error event carrying `message` (the API sends it as the stream's last event, as vLLM does on abort);
        store jobs are dropped. Any thread may call it; the model thread does the work."""
        self.inbox.put(lambda: setattr(self, "closing", message))

    def submit(self, req: Request) -> None:
        seq = Sequence(req, self.model.cfg)
        self._loading(+1)
        self.loads.put(lambda: self._fetch(seq))

    def load(self) -> dict:
        """What waits: requests being loaded or waiting for a step, requests running, store jobs and writes; the KV
        the running requests may hold against the budget (bytes)."""
        s = self.scheduler
        return {"queued": self.loading + len(s.waiting), "running": len(s.running),
                "store_jobs": len(s.store_jobs) + self.connector.pending_writes, "steps": self.steps,
                "kv_bytes": s.kv_used(), "kv_budget": s.kv_budget}

    def tiers(self) -> list:
        """What each tier below the hot cache holds and what its reads have cost (connector.Tiers.stats; [] without
        tiers)."""
        return self.connector.tiers.stats() if self.connector.tiers is not None else []

    # ------------------------------------------------------------------------------------------------ loader
    def _load(self) -> None:
        torch.set_num_threads(1)   # this thread's copies run on one core (module docstring)
        while (work := self.loads.get()) is not None:
            work()

    def _fetch(self, seq: Sequence) -> None:
        try:
            seq.loaded = self.connector.load(seq.prompt)
        except Exception as e:
            self._loading(-1)
            return seq.req.emit("error", message=f"loading the KV failed: {type(e).__name__}: {e}")
        self.inbox.put(lambda: (self.scheduler.add(seq), self._loading(-1)))

    def _loading(self, change: int) -> None:
        with self.lock:
            self.loading += change

    # ------------------------------------------------------------------------------------------------ the model
    def _serve(self) -> None:
        with torch_threads(self.threads), torch.no_grad():
            while not self.stopping:
                try:
                    self.step()
                except Exception as e:   # a bug in a step: every running request is told, the engine serves on
                    traceback.print_exc(file=sys.stderr)
                    for seq in list(self.scheduler.running):
                        self._fail(seq, f"{type(e).__name__}: {e}")
                    self.scheduler.drop_store_jobs()
            for seq in [*self.scheduler.running, *self.scheduler.waiting]:
                seq.req.emit("error", message="the engine stopped")

    def step(self) -> None:
        """Take what came, schedule, run one batch, post-process."""
        self._take(block=self.scheduler.idle())
        s = self.scheduler
        for seq in s.cancelled():
            self._end(seq, "cancelled")
        if self.closing is not None:
            for seq in [*s.running, *s.waiting]:
                self._fail(seq, self.closing)
            s.drop_store_jobs()
        s.admit()
        batch = s.batch()
        if not batch:   # nothing can run until something comes (a request still with the loader)
            return self._take(block=True)
        self.steps += 1
        if batch.blend is not None:
            self._blend(batch.blend)
        items = [Item([seq.next_token], seq.cache, True) for seq in batch.decode]
        items += [Item(unit.todo[:n], unit.cache, unit.logits and n == len(unit.todo), unit.every)
                  for unit, n in batch.pieces]
        logits = runner.run(self.model, items) if items else []
        for seq, lg in zip(batch.decode, logits):
            self._advance(seq, lg)
        for (unit, n), lg in zip(batch.pieces, logits[len(batch.decode):]):
            piece, unit.todo = unit.todo[:n], unit.todo[n:]
            if unit.every:
                unit.score(piece, lg, unit.owner.req.echo_logprobs)
            if not unit.todo:
                self.done(unit, unit.last if unit.every else lg)

    def _take(self, block: bool) -> None:
        """Run what the other threads handed over; wait for it when there is nothing else to do."""
        try:
            work = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
            while True:
                if work is None:
                    self.stopping = True
                    return
                work()
                work = self.inbox.get_nowait()
        except queue.Empty:
            pass

    def _blend(self, seq: Sequence) -> None:
        c, p = self.connector, seq.prompt
        keys = ks.chunk_keys(c.model_id, p.system, p.chunks)
        blocks = seq.blocks + [seq.alone.get(i, b) for i, b in enumerate(seq.loaded.chunks)]
        logits, seq.cache = runner.blend(self.model, p.system, list(p.chunks), p.question, keys, blocks, c.ratio,
                                         c.rule, seq.room)
        seq.cache.limit = seq.limit
        r = seq.loaded.reuse
        r.recomputed = len(p) - r.prefix - r.blended
        self._first(seq, logits)

    def done(self, unit: Prefill, logits) -> None:
        """A prefill unit ran its last piece: what follows depends on its kind."""
        after = {Kind.PROMPT: self._prompt_done, Kind.SYSTEM: self._system_done, Kind.CHUNK: self._chunk_done,
                 Kind.CHECK: self._check_done, Kind.ECHO: self._check_done, Kind.STORE: self._store_done}
        after[unit.kind](unit, logits)

    def _prompt_done(self, unit: Prefill, logits) -> None:
        """The prompt after the held prefix is in its cache: the first answer token."""
        seq = unit.owner
        seq.cache = unit.cache
        r = seq.loaded.reuse
        r.recomputed = len(seq.prompt) - r.prefix
        self._first(seq, logits)

    def _system_done(self, unit: Prefill, logits) -> None:
        """The blend path's system message: saved, and its chunks are prefilled behind it."""
        seq = unit.owner
        block = unit.cache.rows(0, len(unit.cache))
        self.connector.save(system_key(self.connector.model_id, seq.prompt.system), block)
        seq.chunk_parts(block)
        self.scheduler.prefilled(seq)

    def _chunk_done(self, unit: Prefill, logits) -> None:
        """A chunk prefilled alone: saved, and kept for the blend pass."""
        seq = unit.owner
        seq.alone[unit.index] = block = unit.cache.rows(unit.skip, len(unit.cache))
        self.connector.save(message_keys(self.connector.model_id, seq.prompt)[unit.index], block)
        seq.parts.remove(unit)
        self.scheduler.prefilled(seq)

    def _check_done(self, unit: Prefill, logits) -> None:
        """kv_check's full prefill (echo's too, with every prompt token scored): the logits the served ones are
        compared with; an answer that waited for it ends."""
        seq = unit.owner
        seq.check_logits = logits
        if unit.kind is Kind.ECHO:
            seq.prompt_scores = unit.scores
            self._scores(seq)
        if seq.status is Status.CHECKING:
            self._end(seq, seq.finish)

    def _store_done(self, unit: Prefill, logits) -> None:
        """A store job: the chunk prefilled alone is saved."""
        self.scheduler.store_job_done(unit)
        self.connector.save(unit.key, unit.cache.rows(unit.skip, len(unit.cache)))

    # ------------------------------------------------------------------------------------------------ decoding
    def _first(self, seq: Sequence, logits) -> None:
        """The prompt is in the cache: report how it was served, then the first answer token."""
        now = time.perf_counter()
        seq.served_logits = logits
        for job in seq.loaded.store_jobs:   # from now on: a store job never slows the prefill of its own request
            self._add_store_job(job)
        seq.req.emit("start", reuse=seq.loaded.reuse, queue_s=seq.admitted_at - seq.req.queued_at,
                     prefill_s=now - seq.admitted_at)
        seq.started = True
        self._scores(seq)
        self._advance(seq, logits)

    @staticmethod
    def _scores(seq: Sequence) -> None:
        """The prompt's scores (echo), once they are in and "start" was emitted: the API sends them first."""
        if seq.started and seq.prompt_scores is not None:
            seq.req.emit("prompt", scores=seq.prompt_scores)
            seq.prompt_scores = None

    def _advance(self, seq: Sequence, logits) -> None:
        """A new token from `logits` (shaped by the request's bias and penalties): sent (its text past what was sent,
        holding back what may start a stop string), or the answer ends (an end token, a stop string, max_tokens, a
        client gone). Its logprobs, when asked, come from the logits it was picked from."""
        req = seq.req
        logits = seq.shaped(logits)
        token = pick(logits, req.temperature, seq.gen, req.top_p)
        if token in self.end_ids and not req.ignore_eos:
            return self._finish(seq, "stop")
        seq.chose(token)
        score = scored(logits.float().log_softmax(-1), token, req.logprobs) if req.logprobs is not None else None
        text = self.tok.decode(seq.out)
        cut = min((i for i in (text.find(s) for s in req.stop) if i >= 0), default=-1)
        if cut >= 0:   # the text ends before the stop string
            self.flush(seq, text[:cut], token, score)
            return self._finish(seq, "stop", cut=True)
        hold = max(map(len, req.stop), default=1) - 1   # a stop string may be starting: hold back this many characters
        safe = len(text) - hold
        while safe > len(seq.sent) and text[safe - 1] == "\ufffd":   # a character whose bytes are not all in yet
            safe -= 1
        self.flush(seq, text[:safe], token, score)
        if req.cancelled.is_set():
            return self._finish(seq, "cancelled")
        if len(seq.out) >= req.max_tokens:
            return self._finish(seq, "length")
        self.scheduler.decoded(seq, token)

    def _finish(self, seq: Sequence, reason: str, cut: bool = False) -> None:
        if not cut:   # what was held back
            self.flush(seq, self.tok.decode(seq.out), None)
        seq.finish = reason
        self._save(seq)
        if self.scheduler.finished(seq):   # else kv_check's prefill still runs: the end waits for it
            self._end(seq, reason)

    def _end(self, seq: Sequence, reason: str) -> None:
        kl = None
        if seq.req.kv_check and seq.check is not None and seq.served_logits is not None and not seq.check.todo:
            full = seq.check_logits
            if full is not None:
                kl = float(kl_divergence(full.log_softmax(-1), seq.served_logits.log_softmax(-1)))
        self.scheduler.drop(seq)
        seq.req.emit("end", finish_reason=reason, tokens=len(seq.out), kl=kl)

    def _fail(self, seq: Sequence, message: str) -> None:
        self.scheduler.drop(seq)
        seq.req.emit("error", message=message)

    def _save(self, seq: Sequence) -> None:
        """The answered request's exact KV into the store: hot at once (the next step's lookup finds it), the tiers
        written behind."""
        c = self.connector
        if not c.store or seq.cache is None:
            return
        sequence = (seq.prompt.tokens + seq.out[:-1])[:len(seq.cache)]
        for key, block in c.to_save(seq.prompt, seq.loaded.reuse, seq.cache, sequence):
            c.save(key, block)

    def _add_store_job(self, job) -> None:
        """A store job: the chunk prefilled alone behind its system message (from the hot cache when it is there)."""
        s = self.scheduler
        if self.connector.hot.has(job.key) or not s.wants_store_job(job.key):
            return
        system = self.connector.hot.get(system_key(self.connector.model_id, job.system)) if job.system else None
        if system is not None and system.shape[3] == len(job.system):
            unit = Prefill(Kind.STORE, list(job.tokens), SeqCache(system, len(job.tokens)), key=job.key,
                           skip=len(job.system))
        else:
            tokens = [*job.system, *job.tokens]
            unit = Prefill(Kind.STORE, tokens, SeqCache.empty(self.model.cfg, len(tokens)), key=job.key,
                           skip=len(job.system))
        s.add_store_job(unit)

    def flush(self, seq: Sequence, upto: str, token, score=None) -> None:
        """Send the text past what was sent, up to `upto` (with the new token and its score, when there is one)."""
        if len(upto) > len(seq.sent) or token is not None:
            seq.req.emit("text", delta=upto[len(seq.sent):] if len(upto) > len(seq.sent) else "", token=token,
                         scored=score)
        if len(upto) > len(seq.sent):
            seq.sent = upto
