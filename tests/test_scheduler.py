"""The engine's scheduler on its own (engine/scheduler.py), with stand-in requests: no model, no threads. What a step
takes: first come, first served; a prefill in pieces within the step's budget; the store jobs' share kept while one
waits, however much prompt work there is."""
from lecture27.engine.scheduler import Scheduler
from lecture27.engine.sequence import Prefill


class Stand:
    """A request as the scheduler sees it: a phase, its prefill units, no kv_check."""

    def __init__(self, name: str, prompt_tokens: int = 0):
        self.name, self.phase, self.check = name, "wait", None
        self.parts = [Prefill("prompt", list(range(prompt_tokens)), None)] if prompt_tokens else []

    def units(self) -> list:
        return [u for u in self.parts if u.todo] if self.phase == "prefill" else []


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
    for q in (old, new):
        q.phase = "prefill"
    job = Prefill("store", list(range(100)), None)
    s.add_store_job(job)
    assert s.batch().pieces == [(old.parts[0], 48), (job, 16)]
    s.store_jobs.clear()
    assert [(u, n) for u, n in s.batch().pieces] == [(old.parts[0], 64)]   # no job waiting: nothing is kept back
