"""A student answers an exercise by changing a constant at the top of a script (or the library setting
its docstring names). Each test makes that edit (monkeypatch, small sizes), runs the script or the part
the constant drives, and checks that the figure moves the way the lecture says, and that the handout
column goes blank ("-") once the inputs are no longer the handout's."""
import importlib
import json

import numpy as np
import pytest


def script(name):
    return importlib.import_module(f"lecture27.{name}")


def run(mod, tmp_path, capsys, *argv):
    """mod.main(argv) with --json; -> (printed text, JSON)."""
    path = tmp_path / "out.json"
    mod.main([*argv, "--json", str(path)])
    return capsys.readouterr().out, json.loads(path.read_text())


def line_with(text, start):
    return next(ln for ln in text.splitlines() if ln.strip().startswith(start))


# ------------------------------------------------------------------------------------ 01
@pytest.fixture
def ledger01():
    return script("01_kv_ledger")


def handout_beside(page, label):
    """The handout column of the row labelled `label` (a Ref, or "-" when the run's inputs are not its)."""
    return next(r.handout for t in page.tables for r in t.rows if str(r.cells[0]).startswith(label))


def test_01_context_scales_the_kv_and_blanks_the_handout(ledger01, tmp_path, capsys, monkeypatch):
    _, base = run(ledger01, tmp_path, capsys, "--no-plot")
    monkeypatch.setattr(ledger01, "CONTEXT", 64 * 1024)            # exercise 1 with a 64K context
    page = ledger01.main(["--no-plot"])
    assert page.json()["ex1_context_gb"] == pytest.approx(2 * base["ex1_context_gb"], rel=1e-12)
    assert handout_beside(page, "KV of 65,536 tokens") == "-"
    assert handout_beside(page, "KV bytes per token").figure == "327,680 B = 320 KiB"   # per token: still 70B's


def test_01_compression_lowers_the_threshold(ledger01, tmp_path, capsys, monkeypatch):
    _, base = run(ledger01, tmp_path, capsys, "--no-plot")
    monkeypatch.setattr(ledger01, "COMPRESSION", 6.0)               # exercise 2: twice the compression
    page = ledger01.main(["--no-plot"])
    edited = page.json()
    assert edited["ex2_threshold_gbit_per_s"] == pytest.approx(base["ex2_threshold_gbit_per_s"] / 2, rel=1e-12)
    assert handout_beside(page, "break-even bandwidth (compressed)") == "-"


def test_01_day_throughput_and_hit_rate(ledger01, tmp_path, capsys, monkeypatch):
    _, base = run(ledger01, tmp_path, capsys, "--no-plot")
    monkeypatch.setattr(ledger01, "DAY_TOKENS_PER_S", 2 * ledger01.DAY_TOKENS_PER_S)
    monkeypatch.setattr(ledger01, "HIT_RATE", 0.20)                 # twice the hits save twice the GPU time
    page = ledger01.main(["--no-plot"])
    edited = page.json()
    assert edited["gpu_day_tb"] == pytest.approx(2 * base["gpu_day_tb"], rel=1e-12)
    assert edited["slides_gross_savings_musd"] == pytest.approx(2 * base["slides_gross_savings_musd"], rel=1e-12)
    assert handout_beside(page, "KV per day (decimal TB)") == "-"
    assert handout_beside(page, "reading 1 (§1.3)") == "-"
    assert handout_beside(page, "break-even hit rate (a hit saves").figure == "1.06%"   # needs no hit rate


# ------------------------------------------------------------------------------------ 02
def test_02_exercise4_distribution(monkeypatch):
    """Exercise 4 on another distribution (the constant, read through the run's settings): four equally
    likely values need 2 bits, and the handout's 1.40 and 3 bits are no longer beside them."""
    from common.present import DASH, Page
    mod = script("02_cachegen_codec")
    monkeypatch.setattr(mod, "EX4_PROBS", {0: 0.25, 1: 0.25, -1: 0.25, 2: 0.25})
    monkeypatch.setattr(mod, "EX4_SAMPLES", 4000)
    s, defaults, _ = mod.parse([])
    e4 = mod.exercise4(s)
    assert s.ex4_samples == 4000 and e4.entropy_bits == pytest.approx(2.0, abs=1e-12) and e4.fixed_bits == 2
    page = Page("02", "", "", s, defaults, plot=False)
    script("codec.page").show_exercise4(page, e4, s)
    assert page.json()["exercise4"]["entropy_bits"] == e4.entropy_bits
    assert [r.handout for r in page.tables[-1].rows] == [DASH] * 5


def test_02_codec_group_is_read_where_the_codec_is_fitted(monkeypatch):
    from lecture27 import kvcache as kv
    rng = np.random.default_rng(0)
    X = np.cumsum(rng.normal(size=(4, 30, 2, 2, 8)), axis=1).astype(np.float32)
    steps = np.full((2, 2), 0.5)
    monkeypatch.setattr(kv, "CODEC_GROUP", 5)
    spec = kv.fit_codec(X, steps, True)
    h = kv.codec_header(kv.codec_encode(X[0], spec))
    assert spec.group == 5 and len(h["group_bytes"]) == 6          # 30 tokens in groups of 5
    cm = script("codec.measures")
    anchors = np.array([[lv.K_anchor, lv.V_anchor] for lv in cm.delta_variance_ratios(X, kv.CODEC_GROUP)])
    assert anchors.shape == (2, 2) and np.all(anchors > 1)          # a random walk: deltas are smaller


def test_02_level_factor_spaces_the_levels(monkeypatch):
    from lecture27 import kvcache as kv
    rng = np.random.default_rng(1)
    X = rng.normal(size=(3, 20, 2, 2, 8)).astype(np.float32)
    steps = np.full((2, 2), 0.25)
    monkeypatch.setattr(kv, "LEVEL_FACTOR", 2.0)
    monkeypatch.setattr(kv, "N_LEVELS", 3)
    specs, _, _ = kv.level_specs(X, steps)
    assert len(specs) == 3
    for i, s in enumerate(specs):
        assert np.allclose(s.steps, steps * 2.0 ** i)
    bits = [kv.codec_bits(s, X) for s in specs]
    assert bits[0] > bits[1] > bits[2]                               # coarser levels code in fewer bits


@pytest.mark.slow
def test_02_a_library_edit_refits_the_cached_study(monkeypatch):
    """Editing a codec setting changes the cache key, so the study is fitted again (not read stale)."""
    from lecture27.codec import study as cs
    from lecture27 import kvcache as kv
    keys = []
    monkeypatch.setattr(cs, "cached_study", lambda name, ident, compute, refit=False: keys.append(ident) or {})
    cs.record_codec_study()
    monkeypatch.setattr(kv, "CODEC_GROUP", 5)
    monkeypatch.setattr(kv, "LEVEL_FACTOR", 2.0)
    monkeypatch.setattr(cs, "CODEC_N_CALIB", 500)
    cs.record_codec_study()
    assert keys[0] != keys[1]
    assert keys[1]["group"] == 5 and keys[1]["levels"][0] == 2.0 and keys[1]["docs"][0] == 500


@pytest.mark.slow
def test_02_sensitivity_coarser_steps_cost_accuracy():
    """Part 1b (--sensitivity-step): a layer rounded to 8 x its RMS answers worse than at 1/4 x RMS."""
    from lecture27.codec import study as cs
    from lecture27 import kvcache as kv
    world = cs.record_world()
    ctx, q, ans, slots = world["docs"](150, 5)
    X = cs.context_kv(world["model"], ctx)
    sens = script("codec.measures").layer_sensitivity(world["model"], X, (q, ans, slots), kv.kv_rms(X), [0.25, 8.0],
                                                      8.0)
    assert [x.layer for x in sens] == list(range(X.shape[2]))
    assert all(x.kv[8.0] <= x.kv[0.25] for x in sens)
    assert min(x.kv[8.0] for x in sens) < min(x.kv[0.25] for x in sens)


# ------------------------------------------------------------------------------------ 03
@pytest.fixture
def streaming03():
    return script("03_streaming")


@pytest.mark.slow
def test_03_a_longer_context_recomputes_longer_and_blanks_the_handout(streaming03, tmp_path, capsys, monkeypatch):
    _, base = run(streaming03, tmp_path, capsys, "--no-real", "--no-plot")
    monkeypatch.setattr(streaming03, "CONTEXT", 24 * 1024)          # §4.1 with a 24K-token context
    out, edited = run(streaming03, tmp_path, capsys, "--no-real", "--no-plot")
    assert edited["llama31_70b_12k_recompute_s"] > 2 * base["llama31_70b_12k_recompute_s"]   # attention grows too
    assert edited["setup"]["context"] == 24 * 1024 and len(edited["trace_choices"]) == 16
    assert line_with(out, "recompute the context, s").split()[-1] == "-"
    assert "handout: text wins at low bandwidth" not in out


@pytest.mark.slow
def test_03_a_slow_steady_link_leaves_the_finest_level(streaming03, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(streaming03, "STEADY_GBPS", 0.5)            # level0 alone would take 6.5 s of a 4 s SLO
    out, edited = run(streaming03, tmp_path, capsys, "--no-real", "--no-plot")
    assert edited["steady25_choices"] != ["level0"] * 8
    assert "Steady 0.5 Gb/s:" in out and "the finest level throughout" not in out


@pytest.mark.slow
def test_03_half_efficiency_tokens_slows_small_recompute_batches(streaming03, tmp_path, capsys, monkeypatch):
    _, base = run(streaming03, tmp_path, capsys, "--no-real", "--no-plot")
    monkeypatch.setattr(streaming03, "HALF_EFFICIENCY_TOKENS", 1024)
    _, edited = run(streaming03, tmp_path, capsys, "--no-real", "--no-plot")
    assert edited["setup"]["half_tokens"] == 1024
    small, large = (edited["chunk_sizes"][k]["all_text_ttft_s"] / base["chunk_sizes"][k]["all_text_ttft_s"]
                    for k in ("512", "6144"))
    assert small > large > 1                                       # the smaller the batch, the more it costs


@pytest.mark.slow
def test_03_chunk_sizes_and_slo(streaming03, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(streaming03, "CHUNK_SIZES", [768, 3072])
    monkeypatch.setattr(streaming03, "SLO", 3.0)
    out, edited = run(streaming03, tmp_path, capsys, "--no-real", "--no-plot")
    assert set(edited["chunk_sizes"]) == {"768", "3072"} and edited["setup"]["slo_s"] == 3.0
    assert all(c["slo_met"] == (c["ttft_s"] <= 3.0) for c in edited["chunk_sizes"].values())
    assert "SLO 3 s" in line_with(out, "policy ")


# ------------------------------------------------------------------------------------ 04
def rows04(page, first):
    """The printed cells, by column header, of 04's row whose first cell starts with `first`."""
    from common.present import grid
    for t in page.tables:
        headers, body = grid(t)
        for r in body:
            if r[0].strip().startswith(first):
                return dict(zip(headers, r))
    raise KeyError(first)


def part4_page(mod, *argv):
    """04's Part 4 and exercise 8 on the settings of `argv`: (page, timings per model)."""
    from common.present import Page
    page = Page("04", "", "§5", plot=False)
    from lecture27.blend import page as bp
    s = mod.parse(list(argv))[0]
    timings = mod.part4_pipelining(s)
    bp.show_pipelining(page, timings, s)
    bp.show_controller(page, mod.exercise8(s), s)
    return page, timings


@pytest.mark.slow
def test_04_runs_with_other_curve_ratio_and_chunk_len(tmp_path, capsys, monkeypatch):
    """The issue's edit: CURVE_RATIOS = [0.0, 0.1, 0.3, 1.0], CURVE_CHUNK_LENS = [4, 5]; with RATIO 0.1
    and CHUNK_LEN 6 (exercise 6) in the same run, and small sizes."""
    mod = script("04_cacheblend")
    for name, value in (("CURVE_RATIOS", [0.0, 0.1, 0.3, 1.0]), ("CURVE_CHUNK_LENS", [4, 5]), ("RATIO", 0.1),
                        ("CHUNK_LEN", 6), ("DOCS", 60), ("CITY_DOCS", 100)):
        monkeypatch.setattr(mod, name, value)
    page = mod.main(["--no-plot", "--json", str(tmp_path / "out.json")])
    res = json.loads((tmp_path / "out.json").read_text())
    assert res["ratio"] == 0.1 and res["chunk_len"] == 6 and res["curve_ratios"] == [0.0, 0.1, 0.3, 1.0]
    assert set(res["curve"]) == {"c4_deviation", "c4_random", "c5_deviation", "c5_random"}
    assert all(x is None for x in res["curve"]["c4_deviation"])   # chunks of 4 split no record
    c5 = res["curve"]["c5_deviation"]
    assert c5[0] <= 0.5 and c5[-1] >= 0.95                          # full reuse loses split records; r = 1 recovers
    assert res["chunk3_blend10"] is None and "chunk3_blend20" not in res
    assert res["ex6"]["split_records"] == [] and abs(res["ex6"]["reuse_acc"] - res["ex6"]["full_acc"]) <= 0.005
    assert res["unsplit_acc_reuse"] >= 0.95
    blend = rows04(page, "CacheBlend 10%")                          # the handout's r was 20%, its chunks 5
    assert blend["handout split"] == blend["handout unsplit"] == "-"
    assert rows04(page, "chunk length 4: CacheBlend 10%")["handout"] == "-"


def test_04_min_ratio_and_exercise8_inputs(monkeypatch):
    mod = script("04_cacheblend")
    monkeypatch.setattr(mod, "MIN_RATIO", 0.6)
    page, timings = part4_page(mod)
    ex8 = page.json()
    assert ex8["ex8_ratio"] == 0.6 and ex8["ex8_ttft_ms"] == pytest.approx(32 * 12.0)
    assert all(d.ratio >= 0.6 for t in timings.values() for d in t.devices.values())
    labels = [r.cells[0] for t in page.tables for r in t.rows]
    assert "recompute 60%" in labels and "recompute 15%" not in labels
    assert rows04(page, "controller's recompute ratio")["handout"] == "-"
    monkeypatch.setattr(mod, "MIN_RATIO", 0.15)
    monkeypatch.setattr(mod, "READ_MS", 5.0)                        # a faster read hides less recompute
    ex8 = part4_page(mod)[0].json()
    assert ex8["ex8_ratio"] == 0.25 and ex8["ex8_ttft_ms"] == pytest.approx(32 * 5.0)


def test_04_min_ratio_flag_reaches_every_row():
    """--min-ratio (not only the constant) sets the floor the rows and labels report."""
    mod = script("04_cacheblend")
    _, base = part4_page(mod)
    page, timings = part4_page(mod, "--min-ratio", "0.3")
    assert rows04(page, "recompute 30%")
    for model, t in timings.items():
        assert t.floor_layer_ms > base[model].floor_layer_ms


def test_04_systems_and_paper_point(monkeypatch):
    mod = script("04_cacheblend")
    monkeypatch.setattr(mod, "SYSTEMS", [("llama-3.1-8b", 1)])
    monkeypatch.setattr(mod, "PAPER_CONTEXT", 8192)
    page, timings = part4_page(mod)
    assert list(timings) == ["llama-3.1-8b"]
    assert rows04(page, "paper point, LLaMA-3.1-8B, 8192 tokens")["handout"] == "-"


# ------------------------------------------------------------------------------------ 05
@pytest.fixture
def tiers05():
    return script("05_tiered_storage")


@pytest.mark.slow
def test_05_more_documents_than_the_cache_holds(tiers05, tmp_path, capsys, monkeypatch):
    _, base = run(tiers05, tmp_path, capsys, "--no-plot", "--users", "20")
    monkeypatch.setattr(tiers05, "DOCS", 20)                        # 20 x 4096 tokens x 128 KiB > 9 GB
    page = tiers05.main(["--no-plot", "--users", "20"])
    assert page.json()["hinted_doc_hit_rate"] < base["hinted_doc_hit_rate"]
    assert handout_beside(page, "LRU (sees only tokens)") == "-"
    assert handout_beside(page, 'hinted ("will be reused")') == "-"


@pytest.mark.slow
def test_05_slower_cpu_tier_and_another_model(tiers05, tmp_path, capsys, monkeypatch):
    _, base = run(tiers05, tmp_path, capsys, "--no-plot")
    monkeypatch.setattr(tiers05, "CPU_SLOW_GBPS", 5.0)              # an even slower copy path (pitfall 7)
    page = tiers05.main(["--no-plot"])
    edited = page.json()
    assert edited["configs"]["cpu_slow"]["mean_ttft_s"] > base["configs"]["cpu_slow"]["mean_ttft_s"]
    assert edited["cpu_fast_vs_slow_ttft_ratio"] > base["cpu_fast_vs_slow_ttft_ratio"]
    assert importlib.import_module("lecture27.store.tiers_page").HANDOUT("slow_vs_fast", page.settings) is None
    monkeypatch.setattr(tiers05, "MODEL", "llama-3.1-8b")
    monkeypatch.setattr(tiers05, "HANDOFF_MODEL", "llama-3.1-8b")
    page = tiers05.main(["--no-plot", "--users", "20"])
    assert page.settings.model == page.settings.handoff_model == "llama-3.1-8b"
    held = importlib.import_module("lecture27.store.tiers_page").HANDOUT
    assert all(held(k, page.settings) is None for k in ("handoff_gb", "all_kv_gb", "lru", "hinted"))
