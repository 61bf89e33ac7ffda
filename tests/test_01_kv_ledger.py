"""01_kv_ledger.py as a student runs it: every part and exercise is on the page, --json has the spec's keys
with the handout's values (within 5%), and bad flags fail in one line with exit code 2."""
import importlib
import json

import pytest

K = 1024
SPEC = {  # spec section 01, [H] figures
    "llama31_70b_bytes_per_token": 327_680, "llama31_70b_32k_gb": 10.7, "deepseek_r1_kib_per_token": 68.6,
    "gpu_day_tb": 15.9, "recompute_16k_s": 0.97, "ex2_threshold_gbit_per_s": 14.4,
    "slides_breakeven_hit_rate_pct": 1.06, "slides_savings_musd": 33, "slides_storage_musd": 4,
    "ctx10k_storage_usd_per_h": 0.0005, "ctx10k_hit_saves_usd": 0.0026, "ctx10k_breakeven_hits_per_h": 0.19,
}
mod = importlib.import_module("lecture27.01_kv_ledger")


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("01") / "out.json"
    page = mod.main(["--json", str(out)])
    return page, json.loads(out.read_text())


def test_every_part_exercise_and_figure_is_on_the_page(result):
    page, _ = result
    kinds = [(b["kind"], b.get("name") or b.get("n")) for b in page.blocks]
    assert [n for k, n in kinds if k == "part"] == ["Part 1", "Part 2", "Part 3"]
    assert [n for k, n in kinds if k == "exercise"] == [1, 2]
    assert sorted(b["path"].rsplit("/", 1)[1] for b in page.blocks if b["kind"] == "figure") == [
        "01_breakeven_bandwidth.png", "01_kv_size.png"]
    assert all(t.source for t in page.tables) and sum(t.has_handout() for t in page.tables) >= 5


@pytest.mark.parametrize("key", sorted(SPEC))
def test_json_keys_match_spec(result, key):
    _, data = result
    assert data[key] == pytest.approx(SPEC[key], rel=0.05)


def test_the_calibrated_hit_saves_gives_the_handouts_break_even_as_printed(result):
    """HIT_SAVES is not on the slides: it is the one value chosen so that the slides' $0.15 / $16 becomes the
    handout's 1.06%, so the row beside the handout's figure must print it (the source column says so)."""
    _, data = result
    assert f"{data['slides_breakeven_hit_rate_pct']:.2f}%" == mod.HANDOUT.refs["breakeven_pct"].figure


def test_breakeven_list(result):
    _, data = result
    assert len(data["breakeven_gbytes_per_s"]) == len(data["contexts"])
    for n, b in zip(data["contexts"], data["breakeven_gbytes_per_s"]):
        if 4096 <= n <= 65536:
            assert 4 <= b <= 6


def test_the_results_are_named_fields():
    s, _, _ = mod.parse([])
    sizes = mod.kv_sizes(s)
    by = {m.key: m for m in sizes.models}
    assert by["llama-2-7b"].layout.kv_heads == 32 and by["deepseek-r1"].layout.mla_latent == 576
    assert sizes.ex1_bytes == 327_680 * 32 * K
    worth = mod.is_storing_worth_it(s)
    assert [x.context for x in worth.ours] == sorted(set(mod.ECON_CONTEXTS + [mod.STORE_CONTEXT]))


def test_exercise_flags_change_the_answer(tmp_path):
    out = tmp_path / "ex.json"
    page = mod.main(["--model", "llama-2-7b", "--context", "4096", "--compression", "6", "--no-plot",
                     "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["ex1_bytes_per_token"] == 524_288
    assert data["ex1_context_gb"] == pytest.approx(524_288 * 4096 / 1e9)
    assert data["part2_setup"]["model"] == "llama-2-7b" and page.settings.model == "llama-2-7b"


@pytest.mark.parametrize("args", [["--context", "-5"], ["--model", "llama-9000"], ["--compression", "0"],
                                  ["--hit-rate", "2"], ["--hit-saves", "0"], ["--no-such-flag"],
                                  ["--json", "/proc/x.json"]])
def test_bad_flags_one_line_exit_2(args, cli_exit):
    code, err = cli_exit("01_kv_ledger", *args)
    assert code == 2
    assert len(err.strip().splitlines()) == 1
    assert "error" in err and "Traceback" not in err
