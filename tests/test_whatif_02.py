"""02 run as a student runs it after an edit an exercise invites: another distribution for exercise 4,
other coarse steps for Part 1b (--sensitivity-step), the entropy at another level, fewer contexts for
exercise 3. In every run no handout figure stands beside ours unless the run's inputs are the ones it
holds for, every verdict printed under a table says what that run's numbers say, and a what-if run
draws its figures into a folder of its own. Each run reads the cached codec study (about 15 s)."""
import importlib
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from lecture27 import blend_world as bw
from lecture27 import kvcache as kv
from lecture27.codec import page as cp
from lecture27.codec import study as cs
from common.present import holds

RUNS = {  # name: (constants edited, command line)
    "default": ({}, []),
    "uniform4": ({"EX4_PROBS": {0: 0.25, 1: 0.25, -1: 0.25, 2: 0.25}, "EX4_SAMPLES": 4000},
                 ["--sensitivity-step", "0.25"]),
    "three": ({"EX4_PROBS": {0: 0.5, 1: 0.25, -1: 0.25}, "EX4_SAMPLES": 4000, "ENTROPY_LEVEL": 3,
               "EX3_CONTEXTS": 20, "CODER_STREAMS": (4, 64)}, ["--sensitivity-step", "8"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{name: the run's settings, JSON, page blocks, tables by source, figure paths, figures folder}."""
    mod = importlib.import_module("lecture27.02_cachegen_codec")
    out = {}
    for name, (constants, argv) in RUNS.items():
        figs = tmp_path_factory.mktemp(name)
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("L27_FIGURES", str(figs))
            for k, v in constants.items():
                mp.setattr(mod, k, v)
            data = mod.main([*argv, "--json", str(figs / "out.json")])
            settings = mod.parse(argv)[0]
        blocks = json.loads((figs / "pages" / "02.json").read_text())["blocks"]
        tables = {}
        for b in blocks:   # each source's first table (the headline shares the codec table's source)
            if b["kind"] == "table":
                tables.setdefault(b["source"], b)
        out[name] = SimpleNamespace(s=settings, json=data, blocks=blocks, tables=tables, figs=figs,
                                    paths=[b["path"] for b in blocks if b["kind"] == "figure"])
    return mod, out


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_a_handout_figure_only_beside_its_inputs(runs, name):
    """Each handout cell is the figure of a reference whose inputs the run has; exercise 4's go blank
    on another distribution, and stay on the handout's."""
    mod, out = runs
    s, tables = out[name].s, out[name].tables
    for t in (b for b in out[name].blocks if b["kind"] == "table"):
        if not t["handout_col"]:
            continue
        for row in t["rows"]:
            shown = row[-1].rstrip(" *")
            if shown != "-":
                refs = [r for r in cp.HANDOUT.refs.values() if r.figure == shown]
                assert refs and any(holds(r.inputs, s) for r in refs), (t["title"], shown)
    ex4 = tables["coder.exercise4"]["rows"]
    handout_probs = cp.HANDOUT.refs["ex4_entropy_bits"].inputs["ex4_probs"]
    assert (s.ex4_probs == handout_probs) == (ex4[0][-1] == "1.40") == (ex4[3][-1] == "3")


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_verdicts_say_what_the_numbers_say(runs, name):
    mod, out = runs
    d, tables = out[name].json, out[name].tables
    # Part 1b: the layer named as losing the most has the lowest accuracy at the chosen step
    acc = d["layer_sensitivity_acc"]
    note = tables["codec.measures.layer_sensitivity"]["notes"][0]
    if min(acc) == max(acc):
        assert "answers alike" in note
    else:
        low = acc.index(min(acc))
        assert f"layer {low} loses the most" in note
        assert ("not the shallowest" in note) == (low != 0)
    # Part 3: the one-stream coder lands below or over the ideal as the bytes say
    gap = d["ac_actual_bytes"] - d["ac_ideal_bytes"]
    coder = " ".join(tables["codec.measures.coder_check"]["notes"])
    assert f"{abs(gap):.2f} B {'below' if gap < 0 else 'over'}" in coder
    assert ("Lossless" in coder) == d["ac_roundtrip_exact"]
    # the levels: a loss beyond two standard errors is called real, one within them noise
    lv = d["levels"]
    n = cs.CODEC_N_EVAL * bw.N_RECORDS
    gap = lv[0]["accuracy"] - lv[-1]["accuracy"]
    noise = sum(x["accuracy"] * (1 - x["accuracy"]) / n for x in (lv[0], lv[-1])) ** 0.5
    levels_note = tables["codec.study.codec_study"]["notes"][0]
    assert f"points {'below' if gap >= 0 else 'above'} level 0" in levels_note
    assert ("within two standard errors" in levels_note) == (abs(gap) <= 2 * noise)
    # Part 2: "smaller than 8-bit" when the measured codec is
    part2 = tables["codec.measures.record_codecs"]["notes"][0]
    assert f"{d['bytes_8bit'] / d['bytes_measured']:.2f}x smaller than 8-bit" in part2
    # exercise 3: the chain's error is said to add up only where it grows past the anchor's
    rows = [[float(x) for x in r] for r in tables["codec.measures.independence"]["rows"]]
    grows = rows[-1][2] > max(rows[1][2], max(r[1] for r in rows[1:]))
    assert ("errors add up along the chain" in tables["codec.measures.independence"]["notes"][0]) == grows
    # exercise 4: a saving over the fixed-length code is claimed only where there is one
    # exercise 3 measured: the ratios and bytes the notes name are the table's; "slower than the serial
    # coder" only where the fewest streams are; the codec's layout is the one its bitstreams name
    thr, dec = tables["codec.coder_bench.coder_throughput"], d["coder_decode_sym_per_s"]
    notes = " ".join(thr["notes"])
    assert f"decodes {dec['parallel'] / dec['serial']:.1f}x the serial coder's" in notes
    assert f"compiled coder {dec['constriction'] / dec['parallel']:.1f}x ours" in notes
    assert f"{d['coder_parallel_added_bytes'][-1]:+,} bytes" in notes
    assert ("slower than the serial coder" in notes) == (d["coder_parallel_decode_sym_per_s"][0] < dec["serial"])
    streams = d["coder_parallel_streams"]
    assert streams[:-1] == sorted(set(out[name].s.coder_streams)) and streams[-1] == 200 * 256   # all: one a row
    assert d["coder_parallel_added_bytes"][0] == 0 if streams[0] == 1 else d["coder_parallel_added_bytes"][0] > 0
    spec = kv.spec_from_dict(cs.record_codec_study()["specs"][0])
    assert f"bitstreams: {cp.LAYOUT_WORDS[kv.stream_plan(spec, 24).layout]}," in notes
    e4 = d["exercise4"]
    saves = e4["fixed_bits"] - e4["coded_bits_per_symbol"] > 0.005
    assert ("saves nothing" not in tables["coder.exercise4"]["notes"][0]) == saves


@pytest.mark.slow
def test_the_edits_reach_the_results(runs):
    mod, out = runs
    base, four, three = (out[k].json for k in ("default", "uniform4", "three"))
    assert four["exercise4"]["entropy_bits"] == pytest.approx(2.0) and four["exercise4"]["fixed_bits"] == 2
    assert three["exercise4"]["entropy_bits"] == pytest.approx(1.5) and three["exercise4"]["fixed_bits"] == 2
    assert three["exercise4"]["coded_bits_per_symbol"] < 2                 # 3 values: the coder saves
    assert four["layer_sensitivity_step_over_rms"] == 0.25 and min(four["layer_sensitivity_acc"]) > min(
        base["layer_sensitivity_acc"])                                        # finer steps lose less
    assert three["entropy_bits"]["one global table"] < base["entropy_bits"]["one global table"]  # coarser level
    for key in ("levels", "bytes_measured", "acc_measured", "delta_var_ratio"):   # what no edit touched
        assert four[key] == three[key] == base[key]

@pytest.mark.slow
def test_what_if_figures_go_to_a_folder_of_their_own(runs):
    _, out = runs
    for name, run in out.items():
        assert len(run.paths) == 2
        for p in run.paths:
            if name == "default":
                assert p.startswith(str(run.figs)) and "whatif" not in p
            else:   # an edited constant is a what-if as a flag is: its folder names the edits, then their digest
                assert re.search(r"whatif/02_[^/]+_[0-9a-f]{8}/[^/]+$", p), p
    folders = {name: {Path(p).parent for p in run.paths} for name, run in out.items()}
    assert all(len(f) == 1 for f in folders.values()) and len(set.union(*folders.values())) == len(out)


def test_the_handout_is_read_only_through_present_handout():
    """02 names the handout's figures through common.present.handout alone: every use of its HANDOUT table
    is that function's first argument; no call of the table itself, none of its attributes, no lookup of
    02's own."""
    import ast
    folder = Path(cp.__file__).parent
    for path in (folder.parent / "02_cachegen_codec.py", folder / "page.py", folder / "measures.py"):
        tree = ast.parse(path.read_text())
        imported = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                    and n.module == "common.present" for a in n.names}
        lookups = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                   and n.func.id == "handout"]
        uses = [n for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id == "HANDOUT"
                and isinstance(n.ctx, ast.Load)]
        assert all(isinstance(c.args[0], ast.Name) and c.args[0].id == "HANDOUT" for c in lookups), path.name
        assert len(uses) == len(lookups), f"{path.name}: HANDOUT used other than through present.handout"
        assert not lookups or "handout" in imported, f"{path.name}: a handout() that is not common.present's"
        own = [n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and "handout" in n.name.lower()]
        assert not own, f"{path.name}: a handout lookup of its own: {own}"
    assert any(isinstance(n, ast.Call) and getattr(n.func, "id", "") == "handout"
               for n in ast.walk(ast.parse((folder / "page.py").read_text())))
