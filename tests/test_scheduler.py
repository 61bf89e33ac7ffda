"""The engine's scheduler on its own (engine/scheduler.py), with stand-in requests: no model, no threads. Who is
admitted: first come, first served, while the KV budget holds; what a step takes: a prefill in pieces within the
step's budget, the store jobs' share kept while one waits, however much prompt work there is. And the bound that
admission counts on: a request's cache never grows past what kv_need counted. And the state machine: a request's
status changes in scheduler.py and nowhere else."""
import ast
from pathlib import Path

import torch

from lecture27.engine.blocks import SeqCache
from lecture27.engine.scheduler import Scheduler
from lecture27.engine.sequence import Kind, Prefill, Status, kv_need

ENGINE = Path(__file__).resolve().parents[1] / "code" / "lecture27" / "engine"


class Stand:
    """A request as the scheduler sees it: a status, its prefill units (planned already), no kv_check."""

    def __init__(self, name: str, prompt_tokens: int = 0, kv_bytes: int = 0):
        self.name, self.status, self.check, self.kv_bytes = name, Status.LOADING, None, kv_bytes
        self.parts = [Prefill(Kind.PROMPT, list(range(prompt_tokens)), None)] if prompt_tokens else []

    def plan(self) -> None:
        pass

    def units(self) -> list:
        return [u for u in self.parts if u.todo] if self.status is Status.PREFILLING else []

    def release(self) -> None:
        self.released = True


def test_the_oldest_waiting_request_is_admitted_first():
    s = Scheduler(max_running=2)
    for name in "abcd":
        s.add(Stand(name))
    assert [q.name for q in s.admit()] == ["a", "b"]
    s.drop(s.running[0])
    assert [q.name for q in s.admit()] == ["c"]
    assert [q.name for q in s.waiting] == ["d"]


def test_a_busy_step_keeps_its_store_share_and_prompts_are_prefilled_oldest_first():
    """Two long prompts would fill every step: a waiting store job still gets STORE_JOB_TOKENS of each, so a document
    seen once is stored within a few steps of steady traffic; the older prompt gets the rest before the newer."""
    s = Scheduler(step_tokens=64, store_job_tokens=16)
    old, new = Stand("old", 1000), Stand("new", 1000)
    for q in (old, new):
        s.add(q)
    s.admit()
    job = Prefill(Kind.STORE, list(range(100)), None)
    s.add_store_job(job)
    assert s.batch().pieces == [(old.parts[0], 48), (job, 16)]
    s.drop_store_jobs()
    assert [(u, n) for u, n in s.batch().pieces] == [(old.parts[0], 64)]   # no job waiting: nothing is kept back


def test_admission_by_memory_keeps_the_order_and_runs_a_request_alone_whatever_its_size():
    """Budget 100: a (60) runs; b (50) waits at the head, and c (10), which would fit, does not go before it; when a
    ends b joins, then c. A request over the budget runs when nothing else does (the API refuses one that never
    could)."""
    s = Scheduler(kv_budget=100)
    a, b, c = Stand("a", kv_bytes=60), Stand("b", kv_bytes=50), Stand("c", kv_bytes=10)
    for q in (a, b, c):
        s.add(q)
    assert [q.name for q in s.admit()] == ["a"] and s.kv_used() == 60
    s.drop(a)
    assert a.released   # an ended request's KV is let go at once (Sequence.release)
    assert [q.name for q in s.admit()] == ["b", "c"] and s.kv_used() == 60
    big = Stand("big", kv_bytes=150)
    s.add(big)
    assert s.admit() == []
    for q in (b, c):
        s.drop(q)
    assert s.admit() == [big]


def test_a_requests_cache_never_grows_past_what_admission_counted():
    """A cache made with room for a few answer tokens doubles as the answer grows, but never past its limit (the
    prompt and max_tokens), so kv_need's count holds: 100 prompt tokens and 150 answer tokens fit 251 rows."""
    L, H, hd, prompt, answer = 2, 1, 4, 100, 150
    c = SeqCache(torch.zeros(L, 2, H, prompt, hd), extra=8)
    c.limit = prompt + answer + 1
    for _ in range(answer):
        c.reserve(1)
        c.n += 1
        assert c.buf.shape[3] <= c.limit
    assert c.nbytes <= kv_need(2 * L * H * hd * 4, prompt, answer, held=False)


def test_a_request_goes_through_its_statuses_as_the_scheduler_reports_them():
    """LOADING -> WAITING (add) -> PREFILLING (admit, with parts) -> DECODING (decoded) -> DONE (finished, drop); a
    request whose chunks the store all held is BLENDING once admitted; one whose kv_check prefill still runs is
    CHECKING when its answer ends, and its end waits."""
    s = Scheduler()
    q, blended = Stand("q", 10), Stand("blended")
    blended.prompt = type("Prompt", (), {"__len__": lambda self: 10, "question": (1, 2)})()
    for r in (q, blended):
        s.add(r)
        assert r.status is Status.WAITING
    s.admit()
    assert (q.status, blended.status) == (Status.PREFILLING, Status.BLENDING)
    s.decoded(q, 7)
    assert q.status is Status.DECODING and q.next_token == 7
    assert [r.name for r in s.batch().decode] == ["q"] and s.batch().blend is blended
    q.check = Prefill(Kind.CHECK, [1, 2], None)
    assert not s.finished(q) and q.status is Status.CHECKING
    q.check.todo = []
    assert s.finished(q)
    s.drop(q)
    assert q.status is Status.DONE and q not in s.running


def test_the_blend_path_is_due_once_its_last_part_is_prefilled():
    s = Scheduler()
    q = Stand("q", 4)
    s.add(q)
    s.admit()
    s.prefilled(q)
    assert q.status is Status.PREFILLING   # a part is left
    q.parts = []
    s.prefilled(q)
    assert q.status is Status.BLENDING


def test_a_store_job_for_a_chunk_already_queued_is_not_taken_twice():
    s = Scheduler()
    s.add_store_job(Prefill(Kind.STORE, [1], None, key="k"))
    assert not s.wants_store_job("k") and s.wants_store_job("other")


def test_every_status_change_is_in_the_scheduler():
    """An assignment of a Status to `.status` anywhere under engine/ but scheduler.py (and Sequence's first one,
    LOADING, in its constructor) would be a status changed outside the state machine."""
    found = []
    for path in sorted(ENGINE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
                if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for t in targets:
                for el in (t.elts if isinstance(t, ast.Tuple) else [t]):
                    if isinstance(el, ast.Attribute) and el.attr == "status" and "Status." in ast.unparse(node.value):
                        found.append((path.name, ast.unparse(node.value)))
    outside = [f for f in found if f[0] != "scheduler.py"]
    assert outside == [("sequence.py", "(Status.LOADING, None, None)")], outside
    assert len(found) > len(outside)
