"""01_kv_ledger.py run with the edits a student makes (exercise 1's model and context, exercise 2's
compression, the slides' prices): no handout figure stands beside a run whose inputs are not the
handout's, and every verdict says what the run's numbers say."""
import importlib
import re

import pytest

from common.present import DASH, Ref

mod = importlib.import_module("lecture27.01_kv_ledger")
RUNS = {
    "default": [],
    "exercise 1": ["--model", "llama-2-7b", "--context", "4096"],
    "exercise 2": ["--compression", "5", "--recompute-context", "32768"],
    "compression": ["--compression", "6"],
    "slides' hit rate": ["--hit-rate", "0.2"],
    "free storage": ["--storage-usd-per-tb-hour", "0"],
    "8-bit KV": ["--bytes-per-value", "1"],
    "one GPU": ["--n-gpus", "1", "--gpu", "A100-80GB"],
    "time model of another GPU beside the H200": ["--check-gpu", "A100-80GB"],
}


@pytest.fixture(scope="module")
def pages():
    return {name: mod.main([*args, "--no-plot"]) for name, args in RUNS.items()}


def cells(page, label):
    return next(r for t in page.tables for r in t.rows if str(r.cells[0]).startswith(label))


@pytest.mark.parametrize("run", list(RUNS))
def test_a_handout_figure_only_beside_its_inputs(pages, run):
    page = pages[run]
    held = {n for n in mod.HANDOUT.refs if mod.HANDOUT(n, page.settings)}
    shown = [r.handout for t in page.tables for r in t.rows if r.handout not in (None, DASH)]
    figures = {mod.HANDOUT.refs[n].figure for n in held}
    for h in shown:   # a Ref, or several figures joined ("0.97 s, 4-6 GB/s")
        parts = [h.figure] if isinstance(h, Ref) else str(h).split(", ")
        assert all(p in figures for p in parts), (run, h)
    for n in set(mod.HANDOUT.refs) - held:   # quoted in a sentence: the slides' $33M and $29M
        fig = mod.HANDOUT.refs[n].figure
        assert not [t for t in page.texts() if f"handout: {fig}" in t or (fig.startswith("$") and fig in t)], (run, n)
    if run == "default":
        assert held == set(mod.HANDOUT.refs)


@pytest.mark.parametrize("run", [r for r in RUNS if r != "default"])
def test_a_figure_shown_beside_an_edit_stands_beside_an_unchanged_value(pages, run):
    """Where the handout's figure stays, the inputs it holds for are unchanged, so our value beside it must be
    the default run's: a Ref that misses one of its inputs fails here."""
    default = {(t.source, str(r.cells[0])): r.cells[1] for t in pages["default"].tables if len(t.cols) == 2
               for r in t.rows}
    for t in pages[run].tables:
        for r in t.rows:
            if len(t.cols) == 2 and r.handout != DASH:
                assert default.get((t.source, str(r.cells[0]))) == r.cells[1], (run, r.cells[0])


def test_the_edits_blank_what_they_change(pages):
    ex1, ex2, hits = pages["exercise 1"], pages["exercise 2"], pages["slides' hit rate"]
    assert cells(ex1, "KV bytes per token").handout == DASH and cells(ex1, "KV of 4,096 tokens").handout == DASH
    assert all(r.handout == DASH for t in ex1.tables if t.source == "ledger.fetch_or_recompute" for r in t.rows)
    assert cells(ex1, "reading 1").handout.figure == "$33M"            # the slides' account is not the model's
    assert cells(ex2, "break-even bandwidth (compressed)").handout == DASH
    assert cells(ex2, "KV bytes per token").handout.figure.startswith("327,680")
    assert cells(hits, "reading 1").handout == DASH and cells(hits, "storage paid").handout.figure == "~$4M"
    assert cells(hits, "hit rate, fleet, period").cells[2] == "edited"
    assert all(r.handout == DASH for t in pages["8-bit KV"].tables for r in t.rows if t.section == "§1.2")


@pytest.mark.parametrize("run", list(RUNS))
def test_the_verdicts_follow_the_numbers(pages, run):
    page = pages[run]
    own = next(t for t in page.tables if t.source == "ledger.context_economics")
    hits = [r.cells[5].value for r in own.rows]
    verdict = own.notes[0]
    if not any(hits):
        assert verdict.startswith("storage costs nothing")
    elif all(a > b for a, b in zip(hits, hits[1:])):
        assert verdict.startswith("longer contexts pay off sooner")
    else:
        assert "do not pay off sooner" in verdict
    slides = next(t for t in page.tables if t.source == "ledger.slides_economics" and t.title == "")
    storage = next(r.cells[1].json for r in slides.rows if r.cells[0] == "storage paid")
    assert slides.notes[0].startswith("The two readings agree" if storage == 0 else "The two readings disagree")
    net = next(r.cells[1].value for r in slides.rows if r.cells[0].startswith("reading 1"))
    if storage and cells(page, "reading 1").handout == DASH:
        assert net in slides.notes[0]                                   # our figure, not the handout's
    for t in page.texts():
        assert not re.search(r"\(([^()]+?) -> \1\)", t), t                 # no "rises (0% -> 0%)"


def test_every_exercise_has_its_heading_and_every_table_its_source(pages):
    for page in pages.values():
        assert [b["n"] for b in page.blocks if b["kind"] == "exercise"] == [1, 2]
        for t in page.tables:
            module, fn = t.source.rsplit(".", 1)
            assert callable(getattr(importlib.import_module(f"lecture27.{module}"), fn)), t.source


def test_an_edited_run_draws_into_its_own_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("L27_FIGURES", str(tmp_path))
    page = mod.main(["--compression", "5"])
    figures = [b["path"] for b in page.blocks if b["kind"] == "figure"]
    assert len(figures) == 2 and all("/whatif/01_compression=5_" in p for p in figures)
    assert not (tmp_path / "01_kv_size.png").exists()


@pytest.mark.parametrize("tb", [1.0, 4.0])
def test_the_hit_saves_row_names_the_break_even_this_run_computes(tb, monkeypatch):
    """The source of 'a hit saves 88%' is the break-even hit rate it makes in this run's account (1.06% with
    the slides' 1 TB a node, 4.24% with 4 TB), never a figure of another run's."""
    monkeypatch.setattr(mod, "STORAGE_TB_PER_NODE", tb)
    page = mod.main(["--no-plot"])
    source = cells(page, "a hit saves").cells[2]
    breakeven = cells(page, "break-even hit rate (a hit saves").cells[1].value
    assert source == f"ours: what makes {breakeven}" and breakeven == {1.0: "1.06%", 4.0: "4.24%"}[tb]
    assert bool(page.changes) == (tb != 1.0)


def measured(page) -> dict:
    """Part 2's one-GPU table: row key -> its cell in the H200's measured column (a reference column)."""
    t = next(t for t in page.tables if t.source == "01_kv_ledger.one_gpu")
    assert [c.header for c in t.cols if c.reference] == ["H200 measured (2026-12-04)"] and not t.has_handout()
    return {r.key: r.cells[2] for r in t.rows}


def test_the_h200s_measurements_stand_only_beside_the_inputs_they_were_measured_at(pages):
    """The H200's figures stand beside the time model for an H200 with BF16 KV: 8-bit KV blanks the KV copies and
    keeps the prefills, the time model of another GPU blanks every one, an edit of Part 2's model keeps them."""
    default = measured(pages["default"])
    assert default["prefill llama-3.1-8b 12288"] == "348 ms" and default["prefill llama-3.1-8b 32768"] == "1,251 ms"
    assert default["kv llama-3.1-8b 12288 pinned"] == "29.1 ms (55 GB/s)"
    assert default["kv llama-3.1-8b 12288 pageable"] == "92.4 ms (17 GB/s)" and DASH not in default.values()
    eight = measured(pages["8-bit KV"])
    assert all(eight[k] == (DASH if k.startswith("kv ") else default[k]) for k in default)
    assert set(measured(pages["time model of another GPU beside the H200"]).values()) == {DASH}
    assert measured(pages["exercise 1"]) == default and measured(pages["one GPU"]) == default
    time_model = pages["default"].json()["one_gpu_timemodel_s"]
    assert time_model["prefill llama-3.1-8b 12288"] == pytest.approx(0.36)          # the anchor, on an H200
    assert pages["time model of another GPU beside the H200"].json()["one_gpu_timemodel_s"][
        "prefill llama-3.1-8b 12288"] > 0.36                                          # a slower GPU
