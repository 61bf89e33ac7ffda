"""The engine: one model on this CPU, one request at a time, behind a queue.

A request (`Request`) waits in a priority queue; the model thread takes the oldest, prefills its prompt through
the KV connector (connector.py: from the store where it can), then decodes token by token, greedy at temperature
0, else sampled with the request's seed, until `max_tokens`, an end-of-turn token, a stop string, or the client
going away. Each step is reported to the request's `emit` (the API turns the events into a response or a
stream). The time a request waits in the queue is measured apart from its prefill: with one model and one
request at a time, under load that wait is most of a request's time to first token.

Storing is off the request's critical path. A storing thread cuts what the answer left (the request's exact KV,
its messages) into records after the response is sent; a message that must be prefilled alone to be stored
goes back into the model's queue behind every request, so it runs only when no request waits; it runs a piece
at a time, and a request that comes meanwhile is served before the next piece.
"""
from __future__ import annotations

import itertools
import queue
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from common.llama import torch_threads
from lecture27.engine.chat import Prompt
from lecture27.engine.connector import KVConnector, Prefilled

REQUEST, STORE = 0, 1     # the model queue's priorities: every request before any store job
MAX_STORE_JOBS = 64       # store jobs waiting for the model at most; past that a message is not stored alone


@dataclass
class Request:
    """One completion: the prompt, how to decode, and where its events go. emit(kind, **data) is called from
    the model thread: "start" (after the prefill: reuse, queue_s, prefill_s), "text" (delta, token), "end"
    (finish_reason, tokens, kl), "error" (message)."""
    prompt: Prompt
    emit: Callable
    max_tokens: int = 16
    temperature: float = 0.0
    seed: int | None = None
    stop: tuple = ()
    kv_check: bool = False     # also prefill in full and report the first token's KL (what reuse cost)
    cancelled: threading.Event = field(default_factory=threading.Event)
    queued_at: float = field(default_factory=time.perf_counter)


class Engine:
    """The model thread and the storing thread around one model (module docstring). end_ids: the tokens that end
    an answer (the chat format's end of turn, the model's end of text)."""

    def __init__(self, model, tok, connector: KVConnector, end_ids, threads: int = 1):
        self.model, self.tok, self.connector, self.end_ids = model, tok, connector, set(end_ids)
        self.threads = threads
        self.jobs, self.order = queue.PriorityQueue(), itertools.count()
        self.stores = queue.Queue()
        self.waiting = {REQUEST: 0, STORE: 0}
        self.storing = 0          # store jobs handed to the storing thread and not yet done
        self.lock = threading.Lock()
        self.model_thread = threading.Thread(target=self._serve, name="engine-model", daemon=True)
        self.store_thread = threading.Thread(target=self._store, name="engine-store", daemon=True)

    def start(self) -> "Engine":
        self.model_thread.start()
        self.store_thread.start()
        return self

    def stop(self) -> None:
        """Finish the request being served, drop the rest, and end both threads."""
        self._put(REQUEST, None, front=True)
        self.stores.put(None)
        self.model_thread.join(30)
        self.store_thread.join(30)

    def submit(self, req: Request) -> None:
        self._put(REQUEST, req)

    def load(self) -> dict:
        """What waits: requests in the queue, store jobs waiting for the model, records being written."""
        with self.lock:
            return {"queued": self.waiting[REQUEST], "store_jobs": self.waiting[STORE] + self.storing}

    def store(self, job) -> None:
        """Hand a store job to the storing thread (counted from now on, so /health never misses it)."""
        with self.lock:
            self.storing += 1
        self.stores.put(job)

    def _put(self, priority: int, job, front: bool = False) -> None:
        with self.lock:
            if job is not None:
                self.waiting[priority] += 1
        self.jobs.put((priority - 1 if front else priority, next(self.order), job))

    # ------------------------------------------------------------------------------------------------ the model
    def _serve(self) -> None:
        with torch_threads(self.threads), torch.no_grad():
            while True:
                priority, _, job = self.jobs.get()
                if job is None:
                    return
                with self.lock:
                    self.waiting[max(priority, REQUEST)] -= 1
                if priority == STORE:
                    self.store_piece(*job)
                    continue
                try:
                    self.answer(job)
                except Exception as e:   # one request's failure is its own: the engine serves on
                    job.emit("error", message=f"{type(e).__name__}: {e}")

    def store_piece(self, key, pieces) -> None:
        """Run a store job's prefill (connector.prefill_pieces) piece by piece; when it ends, hand its record to
        the storing thread. A request that comes meanwhile is served first: the job goes back behind it, its
        pieces so far kept."""
        for X in pieces:
            if X is not None:
                return self.store(([(key, X)], []))
            if self.waiting[REQUEST]:
                return self._put(STORE, (key, pieces))

    def answer(self, req: Request) -> None:
        """Prefill (through the connector), then decode; the events go to req.emit."""
        if req.cancelled.is_set():
            return req.emit("end", finish_reason="cancelled", tokens=0, kl=None)
        started = time.perf_counter()
        done: Prefilled = self.connector.prefill(req.prompt)
        req.emit("start", reuse=done.reuse, queue_s=started - req.queued_at,
                 prefill_s=time.perf_counter() - started)
        gen = torch.Generator().manual_seed(req.seed if req.seed is not None else random.getrandbits(63))
        logits, cache, out, sent, finish, cut = done.logits, done.cache, [], "", "length", -1
        hold = max(map(len, req.stop), default=1) - 1   # a stop string may be starting: hold back this many characters
        while len(out) < req.max_tokens and finish == "length":
            token = self.pick(logits, req.temperature, gen)
            if token in self.end_ids:
                finish = "stop"
                break
            out.append(token)
            text = self.tok.decode(out)
            cut = min((i for i in (text.find(s) for s in req.stop) if i >= 0), default=-1)
            if cut >= 0:   # the text ends before the stop string
                self.flush(req, sent, text[:cut], token)
                finish = "stop"
                break
            safe = len(text) - hold
            while safe > len(sent) and text[safe - 1] == "\ufffd":   # a character whose bytes are not all in yet
                safe -= 1
            sent = self.flush(req, sent, text[:safe], token)
            if req.cancelled.is_set():
                finish = "cancelled"
            elif len(out) < req.max_tokens:
                lg, cache = self.model(torch.tensor([[token]]), cache=cache, last=True)
                logits = lg[0, -1]
        if cut < 0:   # what was held back
            self.flush(req, sent, self.tok.decode(out), None)
        kl = self.connector.first_token_kl(req.prompt, done.logits) if req.kv_check else None
        if self.connector.tiers is not None:   # queued before the answer ends: a client that waits for /health to
            self.store((req.prompt, done, cache, req.prompt.tokens + out[:-1]))   # be idle finds it stored
        req.emit("end", finish_reason=finish, tokens=len(out), kl=kl)

    @staticmethod
    def flush(req: Request, sent: str, upto: str, token) -> str:
        """Send the text past what was sent, up to `upto` (a longer text than sent): the text sent now."""
        if len(upto) > len(sent) or token is not None:
            req.emit("text", delta=upto[len(sent):], token=token)
        return upto if len(upto) > len(sent) else sent

    @staticmethod
    def pick(logits: torch.Tensor, temperature: float, gen: torch.Generator) -> int:
        if temperature <= 0:
            return int(logits.argmax())
        return int(torch.multinomial((logits / temperature).softmax(-1), 1, generator=gen))

    # ------------------------------------------------------------------------------------------------ storing
    def _store(self) -> None:
        while True:
            job = self.stores.get()
            if job is None:
                return
            try:
                now, later = job if len(job) == 2 else self.connector.to_store(*job)
                for key, X in now:
                    self.connector.tiers.put(key, X)
                for key, chunk in later:
                    if self.waiting[STORE] < MAX_STORE_JOBS:
                        self._put(STORE, (key, self.connector.prefill_pieces(key.prefix, chunk)))
            finally:
                with self.lock:
                    self.storing -= 1
