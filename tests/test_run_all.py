"""run_all runs two scripts side by side and shows their outputs in order: the one on screen as it goes,
the next one's when the first ends, whichever finishes first; a failing run stops it with its exit code."""
import sys

import pytest

from lecture27 import run_all


def run(tmp_path, name: str, seconds: float, code: int = 0) -> run_all.Run:
    src = f"import sys, time; print('{name} begins', flush=True); time.sleep({seconds}); print('{name} ends'); " \
          f"sys.exit({code})"
    return run_all.Run(name, [sys.executable, "-c", src], tmp_path / f"{name}.txt")


def test_outputs_in_order_though_the_second_ends_first(tmp_path, capsys):
    runs = [run(tmp_path, "slow", 1.5), run(tmp_path, "quick", 0.2), run(tmp_path, "last", 0.1)]
    run_all.side_by_side(runs, 2, ["slow", "quick", "last"])
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.endswith(("begins", "ends"))]
    assert lines == ["slow begins", "slow ends", "quick begins", "quick ends", "last begins", "last ends"]
    assert out.index("$ python code/lecture27/quick") > out.index("slow ends")
    assert runs[1].seconds < runs[0].seconds            # quick ran beside slow, not after it
    assert runs[1].t0 < runs[0].t0 + runs[0].seconds


def test_a_run_that_fails_ends_run_all_with_its_code(tmp_path, capsys):
    runs = [run(tmp_path, "fails", 0.1, code=3), run(tmp_path, "never shown", 5)]
    with pytest.raises(SystemExit) as e:
        run_all.side_by_side(runs, 2, [])
    assert e.value.code == 3 and "FAILED: fails" in capsys.readouterr().err
    assert runs[1].proc is None or runs[1].proc.poll() is not None   # the other run is stopped


def test_one_job_runs_them_one_after_another_in_order(tmp_path, capsys):
    runs = [run(tmp_path, "first", 0.3), run(tmp_path, "second", 0.1)]
    run_all.side_by_side(runs, 1, ["second", "first"])
    assert runs[1].t0 >= runs[0].t0 + runs[0].seconds   # the second starts once the first has ended


def test_a_later_run_starts_the_longest_first(tmp_path, monkeypatch):
    """The first run's order waits on what the first runs compute (the record model, SmolLM2's codec); once both small
    models are in the checkpoint folder the runs start longest first. Both orders name every run of run_all."""
    monkeypatch.setenv("L27_CHECKPOINTS", str(tmp_path))
    assert run_all.start_order() == run_all.START_ORDER
    (tmp_path / "records-0-0.pt").write_bytes(b"")
    assert run_all.start_order() == run_all.START_ORDER
    (tmp_path / "city-0-0.pt").write_bytes(b"")
    assert run_all.start_order() == run_all.LATER_ORDER
    names = {" ".join([s]) for s in run_all.SCRIPTS} | {" ".join(r) for r in run_all.REAL_MODEL_RUNS}
    assert names <= set(run_all.START_ORDER) and names <= set(run_all.LATER_ORDER)
