"""05_tiered_storage.py run with the edits a student makes (the CPU tier's size and speed, the GPU's room,
the document cache, fewer users): no handout figure stands beside a run whose inputs are not the
handout's, and every verdict says what the run's numbers say."""
import importlib
import importlib.util
import re

import pytest

from common.present import DASH

mod = importlib.import_module("lecture27.05_tiered_storage")
page_of = importlib.import_module("lecture27.store.tiers_page")     # 05's page: its handout table
RUNS = {   # the issue's two CPU tiers, then the edits the exercises and pitfall 7 invite
    "default": "", "cpu 60 GB": "--cpu-gb 60", "cpu 250 GB": "--cpu-gb 250", "slower copy": "--cpu-slow-gbps 5",
    "smaller GPU": "--gpu-gb 40", "bigger doc cache": "--doc-cache-gb 20", "20 users": "--users 20 --turns 4",
    "cpu below the GPU": "--cpu-gb 20 --gpu-gb 40",
}


@pytest.fixture(scope="module")
def pages():
    """Each run's page (no figures: the last test draws one run's)."""
    out = {}
    for name, args in RUNS.items():
        out[name] = mod.main(args.split() + ["--no-plot"])
    return out


def chat(page):
    return next(t for t in page.tables if t.source == "store.tiers_study.serve")


def config(page, name):
    """The chat table's row `name` as {column header: value}."""
    t = chat(page)
    row = next(r for r in t.rows if r.key == name)
    return {c.header: v for c, v in zip(t.cols, row.cells)}


@pytest.mark.slow
@pytest.mark.parametrize("run", list(RUNS))
def test_a_handout_figure_only_beside_its_inputs(pages, run):
    page = pages[run]
    held = {n for n in page_of.HANDOUT.refs if page_of.HANDOUT(n, page.settings)}
    if run == "default":
        assert held == set(page_of.HANDOUT.refs)
    for n in set(page_of.HANDOUT.refs) - held:
        fig = page_of.HANDOUT.refs[n].figure
        assert not [t for t in page.texts() if f"handout: {fig}" in t], (run, n)
        assert fig not in [str(r.handout) for t in page.tables for r in t.rows], (run, n)
    for n in held:
        assert any(f"handout: {page_of.HANDOUT.refs[n].figure}" in t for t in page.texts()) or any(
            r.handout == page_of.HANDOUT.refs[n].figure for t in page.tables for r in t.rows), (run, n)


@pytest.mark.slow
def test_the_issue_edits(pages):
    for run in ("cpu 60 GB", "cpu 250 GB"):          # the 5x holds for the default CPU tier only
        assert any("(handout: -, pitfall 7)" in t for t in pages[run].texts())
    assert page_of.HANDOUT("slow_vs_fast", pages["slower copy"].settings) is None
    waist = [r.handout for t in pages["bigger doc cache"].tables for r in t.rows if t.source.endswith("doc_hit_rate")]
    assert waist == [DASH, DASH]
    ratio = {run: p.json()["cpu_fast_vs_slow_ttft_ratio"] for run, p in pages.items()}
    assert ratio["cpu 60 GB"] < 1.1 < ratio["default"]   # a CPU tier barely above the GPU's room: hardly used


@pytest.mark.slow
@pytest.mark.parametrize("run", list(RUNS))
def test_the_share_sentence_follows_the_numbers(pages, run):
    page = pages[run]
    slow, fast = config(page, "cpu_slow"), config(page, "cpu_fast")
    a, b = f"{slow['recompute/busy']:.0%}", f"{fast['recompute/busy']:.0%}"
    want = (f"stays at {a}" if a == b else
            f"rises ({a} -> {b})" if fast["recompute/busy"] > slow["recompute/busy"] else f"falls ({a} -> {b})")
    note = next(n for n in chat(page).notes if "cpu_slow recomputes" in n)
    assert f"the share {want}." in note, note
    if note.startswith("recompute/busy is a share"):                      # "... so the share rises"
        assert a != b


@pytest.mark.slow
@pytest.mark.parametrize("run", list(RUNS))
def test_the_cpu50_sentence_follows_the_numbers(pages, run):
    page = pages[run]
    kept = config(page, "cpu50")["hits by tier"][1]
    note = next(n for n in chat(page).notes if n.startswith("cpu50"))
    assert ("never hits" in note) == (kept == 0)
    if kept:
        assert f"{kept:.0%} of the history tokens" in note
    assert ("no bigger than" in note) == (page.settings.cpu_small_gb <= page.settings.gpu_gb)
    for name in ("cpu_slow", "cpu_fast", "cpu_ssd"):       # every CPU tier that inclusion keeps from hitting
        never = config(page, name)["hits by tier"][1] == 0 and page.settings.cpu_gb <= page.settings.gpu_gb
        said = [n for n in chat(page).notes if name in n.split(":")[0] and "never hits" in n]
        assert bool(said) == never, (run, name)
    for t in page.texts():
        assert not re.search(r"\(([^()]+?) -> \1\)", t), t                  # no "rises (0% -> 0%)"


def source_module(name: str):
    """The module a table's source ("module.function") names, under code/lecture27/: a mechanism (tiers) or a
    module of 05's section folder (store.tiers_study)."""
    return importlib.import_module(f"lecture27.{name}")


@pytest.mark.slow
def test_the_exercises_have_headings_and_the_tables_their_sources(pages):
    for page in pages.values():
        assert sorted(b["n"] for b in page.blocks if b["kind"] == "exercise") == [9, 10]
        for t in page.tables:
            if t.source:
                module, fn = t.source.rsplit(".", 1)
                assert callable(getattr(source_module(module), fn)), t.source
        assert all(t.source for t in page.tables if t.has_handout() or any(c.key for c in t.cols))


def test_an_edited_run_draws_into_its_own_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("L27_FIGURES", str(tmp_path))
    page = mod.main(["--cpu-gb", "60", "--users", "20", "--turns", "4"])
    figures = [b["path"] for b in page.blocks if b["kind"] == "figure"]
    assert len(figures) == 3 and all("/whatif/05_cpu_gb=60+turns=4+users=20_" in p for p in figures)
    assert not (tmp_path / "05_handoff.png").exists()


def test_the_rag_notes_say_what_the_printed_numbers_say():
    """A prefix cache whose hit rate prints as 1/k is 'at most 1/k', not 'below'; two TTFTs that print the same
    are 'the same', not '1.0x shorter'; a chunk cache told to recompute nothing does not 'still recompute 0%'."""
    from types import SimpleNamespace as R
    from lecture27.store import tiers_study
    served = {"prefix": [R(hit_rate=0.5004, head_share=1.0, mean_ttft_s=0.0071, busy_share=0.06, reused_share=0.5)],
              "chunk": [R(hit_rate=0.5004, head_share=1.0, mean_ttft_s=0.0072, busy_share=0.06, reused_share=0.5)]}
    r = tiers_study.Rag((2,), [], served)
    assert "at most 1/k, the first document's share, at every k" in page_of.first_doc_note(r)
    assert "(the chunk cache's the same)" in page_of.ttft_note(r)
    s = mod.parse(["--rag-recompute", "0"])[0]
    assert page_of.one_doc_note(r, s) == []                                   # k = 1 is not in the run
    r1 = tiers_study.Rag((1,), [], served)
    assert "is told to recompute none" in page_of.one_doc_note(r1, s)[0]
    assert "below 1/k" in page_of.first_doc_note(tiers_study.Rag((1,), [], served))   # 50% < 100%
