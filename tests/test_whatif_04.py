"""04 run as a student runs it after an edit its exercises invite (small sizes): no handout figure stands
beside a run whose inputs are not the handout's, in a table, a note or a figure's title; every verdict
agrees with the numbers it speaks of; every exercise has its heading, in the handout's order, and
exercise 6 its answer in the default run too. Tests read the page's tables (rows as printed) and the
JSON; a sentence is read only where it is a verdict to hold against its numbers."""
import ast
import importlib
import json
from pathlib import Path

import pytest

from lecture27.blend import page as bp
from lecture27.blend import city_reuse
from common import checkpoints
from common.present import DASH, Page, grid

SMALL = {"DOCS": 60, "CITY_DOCS": 100}


@pytest.fixture(scope="module")
def cb():
    return importlib.import_module("lecture27.04_cacheblend")


@pytest.fixture(scope="module")
def runs(cb, tmp_path_factory):
    """{name: (page, JSON, figure titles by file name)} of main() on the default and two edited inputs."""
    tmp = tmp_path_factory.mktemp("edits04")
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("L27_FIGURES", str(tmp / "figures"))
        for k, v in SMALL.items():
            mp.setattr(cb, k, v)
        titles = {}
        figure = Page.figure

        def spy(self, name, title="", *a, **kw):
            titles[name] = title
            return figure(self, name, title, *a, **kw)

        mp.setattr(Page, "figure", spy)
        for name, argv in {"default": [], "chunk6": ["--chunk-len", "6"], "ratio01": ["--ratio", "0.1"]}.items():
            titles.clear()
            page = cb.main([*argv, "--json", str(tmp / f"{name}.json")])
            out[name] = (page, json.loads((tmp / f"{name}.json").read_text()), dict(titles))
    return out


def test_the_handout_is_looked_up_only_through_present_handout():
    """04 and the modules that show it call no handout table (HANDOUT(...), HANDOUT.figure(...), a .figure(...))
    and define no lookup of their own: every handout figure comes through common.present.handout."""
    lecture = Path(__file__).resolve().parents[1] / "code" / "lecture27"
    for name in ("04_cacheblend.py", "blend/page.py", "blend/rag_page.py", "blend/rag_study.py"):
        tree = ast.parse((lecture / name).read_text())
        calls = [n.func for n in ast.walk(tree) if isinstance(n, ast.Call)]
        direct = [ast.unparse(f) for f in calls if isinstance(f, ast.Name) and f.id == "HANDOUT"
                  or isinstance(f, ast.Attribute) and f.attr == "figure"]
        own = [f.name for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name in ("h", "handout", "said")]
        assert not direct and not own, (name, direct, own)
    page = ast.parse((lecture / "blend" / "page.py").read_text())
    assert any(isinstance(f, ast.Name) and f.id == "handout" for n in ast.walk(page) if isinstance(n, ast.Call)
               for f in [n.func])


def table_with(page, first):
    """(headers, printed rows, Table) of the table holding a row whose first cell starts with `first`."""
    for t in page.tables:
        headers, body = grid(t)
        if any(r[0].strip().startswith(first) for r in body):
            return headers, body, t
    raise KeyError(first)


def cells(page, first):
    """A row's printed cells by column header."""
    headers, body, _ = table_with(page, first)
    return dict(zip(headers, next(r for r in body if r[0].strip().startswith(first))))


def part_settings(cb, *argv):
    return cb.parse(list(argv))[0]


# ------------------------------------------------------------------------------------ the default run
@pytest.mark.slow
def test_every_exercise_has_its_heading_in_the_handouts_order(runs):
    page = runs["default"][0]
    heads = [(b["kind"], b.get("n") or b["name"]) for b in page.blocks if b["kind"] in ("part", "exercise")]
    assert heads == [("part", "Part 0"), ("exercise", 5), ("part", "Part 1"), ("part", "Part 2"), ("exercise", 6),
                     ("part", "Part 3"), ("exercise", 7), ("part", "Part 4"), ("exercise", 8)]


@pytest.mark.slow
def test_exercise6_is_answered_in_the_default_run(runs):
    page, res, _ = runs["default"]
    assert res["chunk_len"] == 5 and res["ex6"]["chunk_len"] == 6
    assert res["ex6"]["split_records"] == [] and res["ex6"]["full_acc"] >= 0.99
    # no record split: full reuse answers as full prefill does, to a question or two of the held-out records for
    # some trained models (seed 3 with one thread: 99.86% against 100%), whose answers read a little across chunks
    assert abs(res["ex6"]["reuse_acc"] - res["ex6"]["full_acc"]) <= 0.005
    notes = " ".join(n for t in page.tables for n in t.notes)
    assert ("full reuse answers exactly as full prefill" in notes) == res["ex6"]["reuse_equals_full"]
    assert cells(page, "records split by chunks of 6")["handout"] == "0"


@pytest.mark.slow
def test_default_run_shows_the_handouts_figures(runs):
    page, res, titles = runs["default"]
    assert cells(page, "top 15% of tokens")["handout"] == "98.0%"
    assert cells(page, "CacheBlend 20%")["handout split"] == "99.4%"
    assert "handout: top 15% hold 98.0%" in titles["04_deviation_concentration.png"]
    assert "split_acc_blend20" in res and "chunk3_blend20" in res


@pytest.mark.slow
def test_the_record_model_line_says_loaded_only_when_it_was(runs):
    page = runs["default"][0]
    line = next(b["text"] for b in page.blocks if b["kind"] == "text" and "record world model" in b["text"])
    loaded = [e["loaded"] for e in checkpoints.EVENTS if e["name"] == "records"]
    assert loaded, "the record model went through the cache"
    assert ("loaded from code/checkpoints/" in line) == loaded[-1]
    assert line.split(": ", 1)[1].startswith("loaded" if loaded[-1] else "trained")


@pytest.mark.slow
def test_figures_of_an_edited_run_stay_out_of_the_default_folder(runs):
    default = [b["path"] for b in runs["default"][0].blocks if b["kind"] == "figure"]
    edited = [b["path"] for b in runs["chunk6"][0].blocks if b["kind"] == "figure"]
    assert len(default) == len(edited) == 5
    # (the small sizes above are edits too: the "default" run is a what-if of its own, in a folder of its own)
    assert all(p.startswith(f"{runs['default'][0].figures}/") for p in default)
    assert all("/whatif/04_chunk_len=6+" in p for p in edited)
    assert runs["default"][0].figures != runs["chunk6"][0].figures


# ------------------------------------------------------------------------------------ --chunk-len 6
@pytest.mark.slow
def test_chunk_len_6_blanks_the_handouts_chunk5_figures(runs):
    page, res, titles = runs["chunk6"]
    for row in ("full prefill", "full reuse", "CacheBlend 20%", "random 20%"):
        c = cells(page, row)
        assert c["handout split"] == c["handout unsplit"] == DASH, row
    for row in ("top 15% of tokens", "rank correlation of deviation", "layer-0 picks"):
        assert cells(page, row)["handout"] == DASH, row
    # the curve's rows keep their own chunk length (5 and 3) at the handout's 20%
    assert cells(page, "chunk length 5: CacheBlend 20%")["handout"] == "99.4%"
    assert cells(page, "chunk length 3: CacheBlend 20%")["handout"] == "81.0%"
    title = titles["04_deviation_concentration.png"]
    assert "handout" not in title and "98" not in title and "chunks of 6" in title
    for first in ("full prefill", "top 15% of tokens"):
        assert not any("handout" in n for n in table_with(page, first)[2].notes)
    assert res["split_acc_blend20"] is None and res["ex6"] == runs["default"][1]["ex6"]


# ------------------------------------------------------------------------------------ --ratio 0.1
@pytest.mark.slow
def test_ratio_names_its_json_keys(runs):
    res = runs["ratio01"][1]
    assert res["ratio"] == 0.1
    assert {"split_acc_blend10", "split_acc_random10", "chunk3_blend10"} <= set(res)
    assert not {"split_acc_blend20", "split_acc_random20", "chunk3_blend20"} & set(res)


@pytest.mark.slow
def test_ratio_01_blanks_the_handouts_20_percent_figures(runs):
    page = runs["ratio01"][0]
    assert cells(page, "CacheBlend 10%")["handout split"] == cells(page, "random 10%")["handout split"] == DASH
    assert cells(page, "full reuse")["handout split"] == "8.8%"          # no ratio in it
    for row in ("layer-0 picks (10%)", "chunk length 3: CacheBlend 10%", "chunk length 5: CacheBlend 10%"):
        assert cells(page, row)["handout"] == DASH, row
    assert not any("handout" in n for n in table_with(page, "random 10%")[2].notes)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["default", "ratio01"])
def test_random_note_places_ours_on_the_right_side_of_the_estimate(runs, name):
    page, res = runs[name][:2]
    r = res["ratio"]
    rand, reuse = res[f"split_acc_random{round(100 * r)}"], res["split_acc_reuse"]
    guess = r + (1 - r) * reuse
    note = table_with(page, f"random {r:.0%}")[2].notes[0]
    side = "above" if rand > guess else "below"
    assert f"Ours: {100 * rand:.1f}%, {side} that estimate" in note


# ------------------------------------------------------------------------------------ Part 4 and exercise 8
def part4(cb, s):
    page = Page("04", "", "§5", plot=False)
    timings = cb.part4_pipelining(s)
    bp.show_pipelining(page, timings, s)
    bp.show_controller(page, cb.exercise8(s), s)
    return page, timings


def test_a_higher_floor_blanks_the_papers_speedups_and_exercise8(cb):
    page, timings = part4(cb, part_settings(cb, "--min-ratio", "0.6"))
    assert cells(page, "TTFT speed-up over full prefill")["handout"] == DASH
    assert all(r[-1] == DASH for r in table_with(page, "LLaMA-2-7B, NVMe SSD, recompute")[1])
    assert not any("2.2-3.3x" in n for n in table_with(page, "TTFT speed-up")[2].notes)
    assert cells(page, "controller's recompute ratio")["handout"] == DASH
    # inputs the floor does not touch keep the handout's figure
    assert cells(page, "paper point, LLaMA-2-7B: NVMe SSD read")["handout"] == "~16"


@pytest.mark.parametrize("argv", [[], ["--min-ratio", "0.6"], ["--min-ratio", "0.05"]])
def test_throughput_verdict_matches_its_rows(cb, argv):
    page, timings = part4(cb, part_settings(cb, *argv))
    s = part_settings(cb, *argv)
    floor_best = all(max(t.throughput, key=lambda r: t.throughput[r].blend_rps) == s.min_ratio
                     for t in timings.values())
    note = table_with(page, "LLaMA-2-7B, NVMe SSD, recompute")[2].notes[0]
    assert ("floor is what throughput wants" in note) == floor_best


def test_a_70b_on_other_gpus_has_no_handout_figure(cb, monkeypatch):
    monkeypatch.setattr(cb, "SYSTEMS", [("llama-2-7b", 1), ("llama-3.1-70b", 4)])
    page, _ = part4(cb, part_settings(cb))
    assert cells(page, "LLaMA-3.1-70B: full recompute")["handout"] == DASH
    assert cells(page, "LLaMA-2-7B: full recompute")["handout"] == "~1x (NVMe almost as slow)"
    assert not any("4.6x" in n for n in table_with(page, "LLaMA-3.1-70B: full recompute")[2].notes)


def test_exercise8_other_read_time(cb):
    page, _ = part4(cb, part_settings(cb, "--read-ms", "5"))
    res = page.json()
    assert res["ex8_ratio"] == 0.25 and res["ex8_ttft_ms"] == pytest.approx(32 * 5.0)
    assert all(cells(page, row)["handout"] == DASH for row in ("controller's recompute ratio", "TTFT, CacheBlend"))
    assert cells(page, "TTFT, full prefill")["handout"] == "640"      # the read time is not in it


# ------------------------------------------------------------------------------------ the city and the command line
@pytest.mark.slow
def test_another_city_chunking_blanks_the_city_figures(cb, monkeypatch):
    """Chunks of 4 words cut the city's 8-word sentences: the handout's 3 x 8 figures go blank, and the
    verdict in the title follows the KL."""
    from common.city import city_model

    monkeypatch.setattr(cb, "CITY_CHUNK_LEN", 4)
    monkeypatch.setattr(cb, "CITY_DOCS", 100)
    s, page = part_settings(cb), Page("04", "", "§5", plot=False)
    model, lang = city_model()
    docs = city_reuse.city_docs(model, lang, s.city_docs, 0, s.city_chunks, s.city_chunk_len)
    bp.show_city(page, city_reuse.city_losses(docs, lang, s.city_chunk_len), s)
    for row in ("cross-entropy, full prefill", "cross-entropy, full reuse", "KL(full prefill"):
        assert cells(page, row)["handout"] == DASH, row
    t = page.tables[0]
    assert not any("handout" in n for n in t.notes)
    assert ("loses nothing" in t.title) == (page.json()["city_kl"] < 1e-3)


@pytest.mark.parametrize("argv,flag", [(["--model", "smollm2", "--ratio", "0.3"], "--real-ratio"),
                                       (["--real-ratio", "0.3"], "--model smollm2")])
def test_each_ratio_flag_belongs_to_its_model(cli_exit, argv, flag):
    code, err = cli_exit("04_cacheblend", *argv)
    assert code == 2 and flag in err and len(err.strip().splitlines()) == 1


# ------------------------------------------------------------------------------ §5.1 Part 0, the controller's fallback
def part0(cb, s):
    page, st = Page("04", "", "§5", plot=False), cb.part0_prefix(s)
    bp.show_prefix(page, st, s)
    return page, st


@pytest.mark.slow
def test_part0_prefix_caching_saves_less_with_every_chunk(runs):
    page, res, titles = runs["default"]
    assert res["prefix_k"] == list(range(1, 11))
    for m in ("llama-2-7b", "llama-3.1-70b"):
        p, b = res["prefix_saved_share"][m], res["blend_saved_share"][m]
        assert all(x > y for x, y in zip(p, p[1:])) and all(0.75 < x < 0.9 for x in b)
        assert len(res["prefix_ttft_s"][m]) == len(res["full_ttft_s"][m]) == 10
        assert res["prefix_ttft_by_device_s"][m]["NVMe SSD"] == res["prefix_ttft_s"][m]
    assert cells(page, "LLaMA-2-7B prefix caching")["handout"] == "the more chunks, the less"
    assert cells(page, "LLaMA-2-7B CacheBlend 15%")["handout"] == "recomputes ~15%"
    assert cells(page, "LLaMA-2-7B full reuse")["handout"] == DASH
    assert "the more chunks, the less" in titles["04_prefix_caching.png"]


def test_part0_verdict_matches_its_shares(cb):
    for argv in ([], ["--min-ratio", "0.6"]):
        s = part_settings(cb, *argv)
        page, st = part0(cb, s)
        note = table_with(page, "LLaMA-2-7B prefix caching")[2].notes[0]
        for m, x in st.systems.items():
            falls = all(b < a for a, b in zip(x.prefix_saved_share, x.prefix_saved_share[1:]))
            said = f"{cb.tm.get_model(m).name}: prefix caching falls with every chunk" in note
            assert said == falls, (argv, m)
        blend = cells(page, f"LLaMA-2-7B CacheBlend {s.min_ratio:.0%}")
        assert blend["handout"] == ("recomputes ~15%" if s.min_ratio == 0.15 else DASH)
        assert all(x.blend_saved_share[0] < 1 - s.min_ratio for x in st.systems.values())


def test_a_read_slower_than_the_prefill_chooses_the_full_prefill(cb):
    """The issue's run: --layers 32 --read-ms 30 --prefill-ms 20 chooses the full prefill (640 ms)."""
    page, _ = part4(cb, part_settings(cb, "--layers", "32", "--read-ms", "30", "--prefill-ms", "20"))
    res = page.json()
    assert res["ex8_choice"] == "full prefill" and res["ex8_ratio"] == 1.0
    assert res["ex8_ttft_ms"] == res["ex8_full_ms"] == pytest.approx(640)
    assert cells(page, "blending from the SSD anyway")["ours"] == "960"
    assert cells(page, "controller's choice")["handout"] == DASH
    default = part4(cb, part_settings(cb))[0].json()
    assert (default["ex8_choice"], default["ex8_ratio"], default["ex8_ttft_ms"]) == ("blend", 0.5, 320.0)


def test_part4_says_which_devices_do_not_pay(cb):
    page, timings = part4(cb, part_settings(cb))
    for model, t in timings.items():
        for d, x in t.devices.items():
            pays = x.load_vs_full > 1                     # the layer's read is faster than its prefill
            assert (x.choice == "blend") == pays, (model, d)
            if not pays:
                fastest = min(t.devices, key=lambda e: t.devices[e].ttft_s)
                assert x.choice in (f"blend from {fastest}", "full prefill")
    rows = table_with(page, "load from SATA SSD")[1]
    assert any(r[0] == "load from SATA SSD" and r[-1].startswith("blend from") for r in rows)


@pytest.mark.slow
def test_the_mask_pitfall_is_measured_beside_the_position_mask(runs):
    page, res, _ = runs["default"]
    assert res["mask_position_split_acc"] == res["split_acc_blend20"]
    assert 0 <= res["mask_pitfall_split_acc"] <= 1
    c = cells(page, "bottom-right mask (the pitfall)")
    assert c["split records"] == f"{100 * res['mask_pitfall_split_acc']:.1f}%"


def test_part4_ranking_by_the_question_waits_for_its_layers(cb):
    """The query rule's TTFT on the time model grows with the layers its ranking reads; every layer (the
    last j) leaves no overlap: all reads, then all recomputes. The rows print what query_wait computed."""
    s = part_settings(cb)
    waits = cb.part4_query_wait(s)
    page = Page("04", "", "§5", plot=False)
    bp.show_pipelining(page, cb.part4_pipelining(s), s, waits)
    for w in waits:
        assert w.depths[-1] == w.n_layers - 1 and w.ttft_s[0] >= w.plain_s - 1e-12 and w.ttft_s[-1] > w.plain_s
        assert all(b >= a - 1e-12 for a, b in zip(w.ttft_s, w.ttft_s[1:]))
        load, rec, q = w.load_ms / 1e3, w.recompute_ms / 1e3, w.pass_ms / 1e3
        assert w.ttft_s[-1] * 1e3 == pytest.approx(1e3 * (w.n_layers * (max(load, q) + rec) + q * w.n_layers))
    rows = table_with(page, "no ranking pass (blend)")[1]
    assert rows[0][1] == f"{1e3 * waits[0].plain_s:.0f}" and rows[-1][0].endswith("(all)")


@pytest.mark.slow
def test_the_query_rule_on_split_records_is_shown_beside_part2(runs):
    page, res, _ = runs["default"]
    assert 0 <= res["query_split_acc"] <= 1 and set(res["input_rules_split_acc"]) == {"query", "query+dev",
                                                                                     "chunk-start"}
    assert cells(page, "query 20%")["split records"] == f"{100 * res['query_split_acc']:.1f}%"


# ------------------------------------------------------------------------------------ Part 4 on one GPU, measured
def one_gpu(page) -> tuple[dict, object]:
    """The one-GPU table of Part 4: {row key: its printed cells by header}, and the Table."""
    t = next(t for t in page.tables if t.source == "blend.timing.one_gpu")
    headers, body = grid(t)
    return {r.key: dict(zip(headers, cells)) for r, cells in zip(t.rows, body)}, t


MEASURED = "H200 measured (2026-12-04)"


@pytest.mark.slow
def test_part4_shows_the_h200s_measurements_in_a_column_of_their_own(runs):
    page, res, _ = runs["default"]
    rows, t = one_gpu(page)
    assert [c.header for c in t.cols if c.reference] == [MEASURED] and not t.has_handout()
    assert rows["recompute llama-2-7b 4096"][MEASURED] == "0.867 ms (32% of the layer)"
    assert rows["layer llama-3.1-70b 4096"][MEASURED] == "10.9 ms"
    assert rows["pipeline llama-2-7b 4096 serial"][MEASURED] == "66.6 ms"
    assert rows["pipeline llama-2-7b 16384 pipelined"][MEASURED] == "159 ms"
    assert rows["pipeline llama-3.1-70b 4096 serial"][MEASURED] == DASH        # the H200 never ran it
    assert res["one_gpu_timemodel_s"]["pipeline llama-2-7b 4096 serial"] == pytest.approx(0.0482, abs=1e-4)
    assert res["one_gpu_timemodel_s"]["pipeline llama-2-7b 4096 pipelined"] == pytest.approx(0.0340, abs=1e-4)


@pytest.mark.parametrize("argv", [["--min-ratio", "0.3"], ["--check-gpu", "H100"]])
def test_a_what_if_blanks_the_measurements_whose_inputs_it_changes(cb, argv):
    """A floor of 30% blanks the recompute and pipeline rows (the H200 recomputed 15%) and keeps a layer's full
    prefill and its KV's read; the time model of another GPU beside them blanks every one."""
    s, defaults, _ = cb.parse(argv)
    page = Page("04", "", "§5", s, defaults, plot=False)
    assert page.changes
    bp.show_one_gpu(page, cb.part4_one_gpu(s), s)
    default = Page("04", "", "§5", plot=False)
    bp.show_one_gpu(default, cb.part4_one_gpu(part_settings(cb)), part_settings(cb))
    rows, shown = one_gpu(page)[0], one_gpu(default)[0]
    for key, cells in rows.items():
        kept = argv[0] == "--min-ratio" and key.split()[0] in ("layer", "layer_kv")
        assert cells[MEASURED] == (shown[key][MEASURED] if kept else DASH), key
    assert any(cells[MEASURED] != DASH for cells in rows.values()) == (argv[0] == "--min-ratio")
