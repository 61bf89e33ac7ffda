"""A measurement cached like a computed result (measured.cached_measurement): a later run shows the same numbers
and says when and where they were measured; another machine, other inputs, other code or --remeasure measure
again; the dataclasses it returns come back as they were (pack/unpack), and only classes of code/ are ever built."""
import dataclasses
import enum

import numpy as np
import pytest
import torch

from common import checkpoints, measured
from common import timemodel as tm
from lecture27.serving import bench


@pytest.fixture
def ckdir(tmp_path, monkeypatch):
    folder = tmp_path / "checkpoints"
    monkeypatch.setenv("L27_CHECKPOINTS", str(folder))
    return folder


def test_pack_and_unpack_give_back_what_was_measured():
    sample = bench.Sample(workload="rag", user=0, turn=1, ttft_s=0.25, total_s=1.0, prompt_tokens=600,
                          cached_tokens=512, completion_tokens=8, text="Paris", error=None, kv=None, kl=0.01,
                          queue_s=0.0)
    x = {"gpu": tm.GPUS["A40"], "samples": [sample], (1, 2): "a tuple key", "t": (1, 2.5, float("inf")),
         "a": np.arange(6, dtype=np.float32).reshape(2, 3), "tensor": torch.ones(2), "none": None}
    y = measured.unpack(measured.pack(x))
    assert y["gpu"] == tm.GPUS["A40"] and y["samples"] == [sample] and y[(1, 2)] == "a tuple key"
    assert y["t"] == (1, 2.5, float("inf")) and isinstance(y["t"], tuple) and y["none"] is None
    assert y["a"].dtype == np.float32 and (y["a"] == x["a"]).all() and torch.equal(y["tensor"], x["tensor"])


class Colour(enum.Enum):
    RED = 1


@dataclasses.dataclass
class NotOurs:
    x: int


def test_only_classes_of_code_are_stored_or_built():
    with pytest.raises(TypeError):
        measured.pack(NotOurs(1))       # a test's class: a later run could not build it
    with pytest.raises(TypeError):
        measured.pack(Colour.RED)
    with pytest.raises(TypeError):
        measured.pack(object())
    with pytest.raises(ValueError):        # a file that names a class elsewhere is refused, never imported
        measured.unpack({"__dataclass__": "os:PathLike", "fields": {}})


def test_a_measurement_is_taken_once_per_machine_inputs_and_code(ckdir, monkeypatch, capsys):
    runs = []

    def measure():
        runs.append(1)
        return {"gpu": tm.GPUS["A40"], "seconds": 1.5 + len(runs)}

    first, info = measured.cached_measurement("clock", {"n": 1}, measure, tag="t")
    assert runs == [1] and not info["loaded"] and "in this run" in measured.measured_note(info)
    again, info = measured.cached_measurement("clock", {"n": 1}, measure, tag="t")
    assert runs == [1] and again == first and info["loaded"]
    out = capsys.readouterr().out
    assert f"measured on {measured.this_machine()} on {info['when']}" in out and "--remeasure" in out
    assert info["when"] in measured.measured_note(info) and "--remeasure" in measured.measured_note(info)
    measured.cached_measurement("clock", {"n": 2}, measure, tag="t")              # another input (a what-if)
    assert len(runs) == 2
    measured.cached_measurement("clock", {"n": 1}, measure, remeasure=True, tag="t")
    assert len(runs) == 3
    monkeypatch.setattr(measured, "this_machine", lambda: "another CPU, 8 cores")
    _, info = measured.cached_measurement("clock", {"n": 1}, measure, tag="t")    # a time of another machine
    assert len(runs) == 4 and info["machine"] == "another CPU, 8 cores"


def test_a_modules_private_state_is_not_part_of_a_key(monkeypatch):
    """redis_server's _spawner holds the pid of the process that started a server: a result measured after a Redis
    server was started here and one loaded before any was started have the same key."""
    from common import redis_server
    before = checkpoints.code_identity(redis_server.spawn)
    assert before["code"]       # the walk reached the function that reads it
    monkeypatch.setattr(redis_server, "_spawner", (12345, "a queue"))
    assert checkpoints.code_identity(redis_server.spawn) == before


def test_the_served_engines_code_keys_its_measurement(monkeypatch):
    """The engine runs in a process of its own, out of reach of the cache's walk: the source of serve.py, of engine/,
    of the mechanisms and of common/ is an input of a served measurement; the other programs' is not."""
    from pathlib import Path

    from lecture27.serving import launch
    before, read = launch.engine_source(), Path.read_bytes
    code = launch.SERVE.parent
    for edited, counts in ((launch.SERVE, True), (code / "engine" / "scheduler.py", True), (code / "kvstore.py", True),
                           (code.parent / "common" / "llama.py", True), (code / "04_cacheblend.py", False),
                           (code / "bench_serve.py", False)):
        with monkeypatch.context() as m:
            m.setattr(Path, "read_bytes", lambda p: read(p) + (b"# an edit" if p == edited else b""))
            assert (launch.engine_source() != before) == counts, edited   # another program's edit is not the engine's
    assert launch.engine_source() == before
