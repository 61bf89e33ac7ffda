"""What the five scripts print, read as a student reads it beside the handout: every Part's heading
names its handout section, no line is wider than 120 characters, every exercise of §10 is answered
("exercise N") in the script its section points to, the handout's headline figures stand beside ours,
and the differences from the handout are explained under their tables. Each script runs once, at
small sizes, with its figures in a temporary folder."""
import contextlib
import importlib
import io
import json
import re

import pytest

pytestmark = pytest.mark.slow   # every script runs once: 02 and 04 train their small models

SCRIPTS = {
    "01": ("01_kv_ledger", [], {}),
    "02": ("02_cachegen_codec", [], {}),
    "03": ("03_streaming", ["--no-real", "--no-plot"], {}),
    "04": ("04_cacheblend", [], {"DOCS": 60, "CITY_DOCS": 100}),
    "05": ("05_tiered_storage", ["--users", "20", "--turns", "4", "--no-plot"], {}),
}
# §10's exercises and the script the handout's section points to
EXERCISES = {1: "01", 2: "01", 3: "02", 4: "02", 5: "04", 6: "04", 7: "04", 8: "04", 9: "05", 10: "05"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{script key: (printed text, JSON)}, each script run once."""
    tmp = tmp_path_factory.mktemp("output")
    out = {}
    for key, (name, args, constants) in SCRIPTS.items():
        mod = importlib.import_module(f"lecture27.{name}")
        old = {k: getattr(mod, k) for k in constants}
        for k, v in constants.items():
            setattr(mod, k, v)
        buf, path = io.StringIO(), tmp / f"{key}.json"
        try:
            with contextlib.redirect_stdout(buf):
                mod.main([*args, "--json", str(path)])
        finally:
            for k, v in old.items():
                setattr(mod, k, v)
        out[key] = (buf.getvalue(), json.loads(path.read_text()))
    return out


@pytest.mark.parametrize("key", list(SCRIPTS))
def test_no_printed_line_is_wider_than_120(runs, key):
    wide = [ln for ln in runs[key][0].splitlines() if len(ln) > 120]
    assert not wide, f"{len(wide)} lines over 120, e.g. {wide[0][:80]!r}"


@pytest.mark.parametrize("key", list(SCRIPTS))
def test_every_part_heading_names_its_section(runs, key):
    heads = [ln for ln in runs[key][0].splitlines() if re.match(r"(== )?Part \d", ln)]
    assert len(heads) >= 3
    assert all("§" in h for h in heads), [h for h in heads if "§" not in h]


@pytest.mark.parametrize("n", sorted(EXERCISES))
def test_every_exercise_is_answered_in_its_script(runs, n):
    text = runs[EXERCISES[n]][0]
    assert re.search(rf"\bexercise {n}\b", text, re.IGNORECASE)
    others = [k for k in SCRIPTS if k != EXERCISES[n] and re.search(rf"\bexercise {n}\b[^-]", runs[k][0], re.I)]
    assert not others, f"exercise {n} also answered in {others}"


def test_the_four_headlines_are_printed_beside_ours(runs):
    t02, t03, t04, t05 = (runs[k][0] for k in ("02", "03", "04", "05"))
    assert "§3.4 headline" in t02 and "3.5-4.3x" in t02 and "3-10x" in t02 and "2-8x" in t02
    assert "§4.1 headline" in t03 and "3.2-3.7x" in t03
    tput = [ln for ln in t04.splitlines() if "NVMe SSD, recompute" in ln]
    assert tput and all("2.8-5x" in ln for ln in tput)
    assert "§7" in t05 and "narrow waist" in t05 and "OpenAI API" in t05


def test_03_headline_is_the_size_ratio_to_8bit(runs):
    """With the transfer alone in the model, 8-bit TTFT / level0 TTFT is 8 bits over level0's bits per value."""
    res = runs["03"][1]
    want = 8 / res["levels_bits_per_value"]["level0"]
    for g, ratio in res["vs_8bit_at_gbit_per_s"].items():
        assert ratio == pytest.approx(want, rel=0.02), g


def explained_under(text, table_start, words, within=12):
    """`words` appear within `within` lines after the line that starts with table_start."""
    lines = text.splitlines()
    i = next(i for i, ln in enumerate(lines) if ln.strip().startswith(table_start))
    return words in "\n".join(lines[i:i + within])


def page_blocks(script):
    """What a script's page recorded (figures/pages/<script>.json): parts, tables with their notes, figures."""
    from common.present import figures_dir
    return json.loads((figures_dir() / "pages" / f"{script}.json").read_text())["blocks"]


def test_02_differences_are_explained_under_their_tables(runs):
    """02's tables whose figures differ from the handout's carry notes (the page's record of the run)."""
    tables02 = {b["source"]: b for b in page_blocks("02") if b["kind"] == "table"}
    assert tables02["codec.measures.coder_check"]["notes"] and tables02["codec.study.codec_study"]["notes"]


def test_04_differences_are_explained_under_their_tables(runs):
    """04's tables whose figures differ from the handout's carry notes (the page's record of the run)."""
    tables = [b for b in page_blocks("04") if b["kind"] == "table"]
    for first in ("true entropy of words", "random 20%", "TTFT speed-up over full prefill"):
        t = next(t for t in tables if any(r[0].strip().startswith(first) for r in t["rows"]))
        assert t["notes"] and any(h.startswith("handout") for h in t["headers"]), first


def test_exercise5_k_rotates_v_stays(runs):
    """K computed at 0 and rotated by 1000 equals K computed at 1000; unrotated it does not; V is equal."""
    e5 = runs["04"][1]["ex5"]
    assert e5["k_rotated_max_diff"] < 1e-4
    assert e5["k_unrotated_max_diff"] > 0.1 * e5["k_max_abs"]
    assert e5["v_max_diff"] < 1e-4
    assert e5["kl_unrotated"] > e5["k_rotated_max_diff"]


def test_exercise7_layer1_check_costs_a_layer(runs):
    for e in runs["04"][1]["ex7"]:
        assert e["layer0_ms"] < 0.5 * e["full_layer_ms"]       # a fraction of a layer
        assert e["layer1_ms"] > e["full_layer_ms"]             # a whole layer of prefill, then the check
        assert e["layer1_gflop"] > e["layer0_gflop"]


def test_throughput_headline_at_the_floor(runs):
    """A busy server: CacheBlend at the 15% floor serves more requests/s than full prefill."""
    for t in runs["04"][1]["timing"].values():
        floor = t["throughput"][min(t["throughput"], key=float)]
        assert floor["blend_rps"] > 1.2 * floor["full_rps"]


def test_exercise9_quantities(runs):
    e9 = runs["05"][1]["exercise9"]
    assert e9["copies"]["library"] > e9["copies"]["service"]
    assert e9["handoff_s"]["library"] > e9["handoff_s"]["service"]
    assert e9["memory_gb"]["library"] == pytest.approx(e9["engines"] * e9["memory_gb"]["service"])
    assert e9["restart_s"]["library"] > e9["restart_s"]["service"]
    assert 0 < e9["ipc_ms"] < 1
