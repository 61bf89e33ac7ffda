"""The trained-checkpoint cache: train once then load; a broken file or a changed config retrains;
an interrupted save leaves the old file intact. (tests/test_cache.py: a change to the code retrains.)"""
import pytest
import torch

from common import checkpoints
from common.checkpoints import TrainingFailed, cached_model
from common.llama import LlamaConfig

CFG = LlamaConfig(vocab_size=11, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8, d_ff=32)


@pytest.fixture
def ckdir(tmp_path, monkeypatch):
    monkeypatch.setenv("L27_CHECKPOINTS", str(tmp_path))
    return tmp_path


def counting_trainer():
    calls = []

    def train_fn(model):
        calls.append(1)
        with torch.no_grad():
            model.embed.weight.fill_(0.5)
        return {"loss": 1.0}
    return train_fn, calls


def test_second_call_loads_without_training(ckdir):
    fn, calls = counting_trainer()
    m1, meta = cached_model("toy", CFG, {"steps": 1}, fn)
    m2, meta2 = cached_model("toy", CFG, {"steps": 1}, fn)
    assert len(calls) == 1
    assert torch.equal(m2.embed.weight, m1.embed.weight)
    assert meta2["metrics"] == {"loss": 1.0} and meta2["torch"] == torch.__version__
    assert "train_seconds" in meta2 and meta2["ident"]["model"]["d_model"] == 16
    assert len(list(ckdir.glob("toy-*.pt"))) == 1


def test_retrain_flag_trains_again(ckdir):
    fn, calls = counting_trainer()
    cached_model("toy", CFG, {}, fn)
    cached_model("toy", CFG, {}, fn, retrain=True)
    assert len(calls) == 2


def test_corrupted_file_is_retrained_with_a_message(ckdir, capsys):
    fn, calls = counting_trainer()
    cached_model("toy", CFG, {}, fn)
    (path,) = ckdir.glob("toy-*.pt")
    path.write_bytes(b"not a checkpoint")
    capsys.readouterr()
    cached_model("toy", CFG, {}, fn)
    assert len(calls) == 2
    out = capsys.readouterr().out
    assert "unusable" in out and "training it again" in out
    cached_model("toy", CFG, {}, fn)  # the rewritten file is good again
    assert len(calls) == 2


def test_file_with_foreign_config_is_not_used(ckdir, capsys):
    fn, calls = counting_trainer()
    cached_model("toy", CFG, {}, fn)
    (path,) = ckdir.glob("toy-*.pt")
    blob = torch.load(path, weights_only=True)
    blob["key"]["inputs"]["train"] = {"steps": 999}  # as if another run had written this name
    torch.save(blob, path)
    cached_model("toy", CFG, {}, fn)
    assert len(calls) == 2 and "stored key differs" in capsys.readouterr().out


def test_changed_config_trains_a_new_file(ckdir):
    fn, calls = counting_trainer()
    cached_model("toy", CFG, {"lr": 1}, fn)
    cached_model("toy", CFG, {"lr": 2}, fn)
    cached_model("toy", CFG, {"lr": 2}, fn, seed=1)
    assert len(calls) == 3 and len(list(ckdir.glob("toy-*.pt"))) == 3


def test_interrupted_save_leaves_old_file_intact(ckdir, monkeypatch):
    fn, calls = counting_trainer()
    cached_model("toy", CFG, {}, fn)
    (path,) = ckdir.glob("toy-*.pt")
    before = path.read_bytes()

    def killed(obj, f):  # dies half-way through writing
        with open(f, "wb") as fh:
            fh.write(b"half a fi")
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoints.torch, "save", killed)
    with pytest.raises(KeyboardInterrupt):
        cached_model("toy", CFG, {}, fn, retrain=True)
    assert path.read_bytes() == before
    assert [p.name for p in ckdir.iterdir()] == [path.name]  # no temporary file left behind


def test_failed_training_is_not_cached(ckdir):
    def bad(model):
        raise TrainingFailed("no drop")
    with pytest.raises(TrainingFailed):
        cached_model("toy", CFG, {}, bad)
    assert not list(ckdir.glob("toy-*.pt"))


def test_train_lm_adds_the_extra_loss():
    """extra_loss(model, step) is added to the loss: a penalty on one weight's size shrinks it."""
    import torch
    from common.trainer import train_lm
    from common.llama import Llama, LlamaConfig

    def batch_fn(step, g):
        x = torch.randint(0, 8, (4, 6), generator=g)
        return x, x, torch.ones(x.shape)

    norms = {}
    for weight in (0.0, 10.0):
        torch.manual_seed(0)
        m = Llama(LlamaConfig(vocab_size=8))
        seen = []

        def extra(model, step, weight=weight):
            seen.append(step)
            return weight * model.layers[0].wq.weight.pow(2).sum()

        hist = train_lm(m, batch_fn, 30, 1e-2, warmup=1, extra_loss=extra)
        assert seen == list(range(30)) and len(hist["extra"]) == 30
        norms[weight] = float(m.layers[0].wq.weight.detach().norm())
    assert norms[10.0] < 0.5 * norms[0.0]


# ------------------------------------------------------------------------------ cached_result
def counting_compute(value):
    calls = []

    def compute():
        calls.append(1)
        return {"value": value}
    return compute, calls


def test_cached_result_computes_once_then_loads(ckdir):
    compute, calls = counting_compute(3)
    a = checkpoints.cached_result("study", {"n": 1}, compute)
    b = checkpoints.cached_result("study", {"n": 1}, compute)
    assert calls == [1] and a["value"] == b["value"] == 3 and "compute_seconds" in b
    checkpoints.cached_result("study", {"n": 2}, compute)   # another identity: another file
    assert calls == [1, 1] and len(list(ckdir.glob("study-*.pt"))) == 2


@pytest.mark.parametrize("damage", ["garbage", "truncated", "foreign", "no result"])
def test_cached_result_recomputes_a_corrupted_or_foreign_file(ckdir, capsys, damage):
    """A file that does not load, or that holds another identity (a file copied over from elsewhere),
    is never used: the result is recomputed with a message and the file rewritten."""
    compute, calls = counting_compute(3)
    checkpoints.cached_result("study", {"n": 1}, compute)
    path, = ckdir.glob("study-*.pt")
    if damage == "garbage":
        path.write_bytes(b"not a checkpoint at all")
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[:40])
    elif damage == "foreign":   # a valid file whose stored identity is not this one's
        key = dict(torch.load(path, weights_only=True)["key"], inputs={"n": 99})
        torch.save({"key": key, "seconds": 0.0, "result": {"value": -1}}, path)
    else:
        blob = torch.load(path, weights_only=True)
        torch.save({"key": blob["key"]}, path)
    capsys.readouterr()
    compute2, calls2 = counting_compute(4)
    out = checkpoints.cached_result("study", {"n": 1}, compute2)
    assert calls2 == [1] and out["value"] == 4
    assert "unusable" in capsys.readouterr().out
    again, calls3 = counting_compute(5)
    assert checkpoints.cached_result("study", {"n": 1}, again)["value"] == 4 and calls3 == []  # rewritten


TWO_RUNS = """
import time
from common.checkpoints import cached

def compute():
    with open({log!r}, "a") as f:
        f.write("computed\\n")
    time.sleep(1.5)
    return {{"x": 1}}

print("result", cached("shared", {{"n": 1}}, compute)["x"])
"""


@pytest.mark.slow
def test_two_runs_at_once_compute_a_result_once(ckdir, tmp_path):
    """run_all runs two scripts side by side: of two processes that need one result at once, one computes it
    and the other waits for it, says so, and loads it."""
    import subprocess
    import sys
    log = tmp_path / "computed.txt"
    src = TWO_RUNS.format(log=str(log))
    procs = [subprocess.Popen([sys.executable, "-c", src], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=60)[0] for p in procs]
    assert all(p.returncode == 0 and "result 1" in o for p, o in zip(procs, outs)), outs
    assert log.read_text().count("computed") == 1
    assert sum("waiting for it" in o for o in outs) == 1, outs


def test_a_held_models_cache_key_and_a_tensor_constants_values_are_part_of_the_key():
    """A study built on a cached model is keyed by that model's checkpoint (a retrained model recomputes
    it); a tensor constant is keyed by its values, not only its shape."""
    import functools

    from common.llama import kl_divergence
    m = torch.nn.Linear(2, 2)
    m.cache_key = "records-a"
    a = checkpoints.code_identity(functools.partial(kl_divergence, m))      # compute() holds the model
    m.cache_key = "records-b"
    assert checkpoints.code_identity(functools.partial(kl_divergence, m))["values"] != a["values"]
    canon = lambda v: checkpoints._canon(v, lambda f: None)  # noqa: E731
    assert canon(torch.zeros(3)) != canon(torch.ones(3)) and canon(torch.zeros(3)) == canon(torch.zeros(3))
