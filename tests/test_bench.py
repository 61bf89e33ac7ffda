"""The benchmark (serving/bench.py, bench_serve.py) without a server: the one percentile, the workloads' requests (new
orders, never the warm-up's; chat8's one shape; no item shared between workloads), users who send each request the
moment the answer before it ends and never look at /health meanwhile (a fake client), and the tables and ratios
block from made-up samples. One test runs every workload, tiny, on the real engine (skipped without SmolLM2)."""
import importlib
import json
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from common.present import Page
from common.stats import percentile
from lecture27 import streaming as st
from lecture27.serving import bench, floor, launch
from lecture27.serving import page as sp
from lecture27.serving.bench_server import REFERENCE, REUSE_SHORT, REUSES, BenchServer

bench_serve = importlib.import_module("lecture27.bench_serve")


# ------------------------------------------------------------------------------------------------ the percentile
def test_percentile_is_the_nearest_rank_everywhere():
    """ceil(q n)-th smallest: on an even count the median is the lower middle value; p99 of fewer than 100 values
    is the largest. The benchmark's Run.p and the streaming suite's ttft_percentile give the same."""
    assert percentile([1, 2, 3, 4], 0.5) == 2 and percentile([4, 3, 2, 1], 0.5) == 2
    assert percentile([1, 2, 3, 4], 0.25) == 1 and percentile([1, 2, 3, 4], 0.26) == 2
    assert percentile(range(1, 11), 0.99) == 10 and percentile([5], 0.01) == 5 and percentile([1, 2, 3], 1) == 3
    assert percentile(range(1, 101), 0.99) == 99 and percentile(range(1, 101), 0.95) == 95
    assert [percentile(range(1, 101), q / 100) for q in range(1, 101)] == list(range(1, 101))   # no float's rank off
    for bad in (([], 0.5), ([1], 0), ([1], 1.5)):
        with pytest.raises(ValueError):
            percentile(*bad)
    ttfts = [0.4, 0.1, 0.3, 0.2]
    assert st.ttft_percentile([SimpleNamespace(ttft_s=t) for t in ttfts], 0.5) == 0.2
    assert run("s", "rag", ttfts).p(0.5) == 0.2 and run("s", "rag", ttfts).p(0.99) == 0.4
    assert run("s", "rag", [None]).p(0.5) is None


# ------------------------------------------------------------------------------------------------ the workloads
def order_of(messages, item, docs, words) -> tuple:
    texts = bench.rag_documents(item, docs, words)
    return tuple(texts.index(m["content"]) for m in messages[1:-1])


def test_rag_requests_bring_each_items_documents_back_in_new_orders_never_the_warmups():
    docs, words = 4, 30
    warm = bench.rag_warmup(2, docs, words)
    assert [order_of(m, i, docs, words) for i, m in warm] == [(0, 1, 2, 3)] * 2
    work = bench.rag_workload(20, 2, docs, words)
    assert [i for i, _ in work] == [0, 1] * 10
    for item in (0, 1):
        orders = [order_of(m, i, docs, words) for i, m in work if i == item]
        assert len(set(orders)) == len(orders) == 10 and (0, 1, 2, 3) not in orders
        assert all(sorted(o) == [0, 1, 2, 3] for o in orders)
    assert {m[-1]["content"] for _, m in work} == {m[-1]["content"] for _, m in warm}   # each item's question last
    assert bench.rag_orders(2, docs) == 46
    assert len(bench.rag_workload(46, 2, docs, words)) == 46
    with pytest.raises(ValueError, match="orders besides their first"):
        bench.rag_workload(47, 2, docs, words)


def test_reorder_moves_every_document_and_no_workload_shares_an_item():
    """reorder's second order keeps no document in its place (nothing but the system message is a prefix of the
    first); bench_serve's rag items, repeat's and reorder's share no document."""
    first, moved = bench.reorder_messages(5)
    assert order_of(first, 5, bench.RAG_DOCS, bench.DOC_WORDS) == tuple(range(bench.RAG_DOCS))
    o = order_of(moved, 5, bench.RAG_DOCS, bench.DOC_WORDS)
    assert sorted(o) == list(range(bench.RAG_DOCS)) and all(i != k for k, i in enumerate(o))
    assert first[0] == moved[0] and first[-1] == moved[-1]
    n = bench_serve.RAG_ITEMS
    rag = {m["content"] for _, ms in bench.rag_workload(bench_serve.RAG_REQUESTS, n) for m in ms[1:-1]}
    repeat = {m["content"] for m in bench.repeated_messages(n)[1:-1]}
    reorder = {m["content"] for m in bench.reorder_messages(n + 1)[0][1:-1]}
    assert len(rag) == n * bench.RAG_DOCS and len(repeat) == len(reorder) == bench.RAG_DOCS
    assert not rag & repeat and not rag & reorder and not repeat & reorder


def test_chat8_requests_have_one_shape_and_the_lone_one_is_none_of_the_crowds():
    crowd = [bench.crowd_messages(u) for u in range(9)]   # 8 users, the 9th the lone request
    assert {len(m) for m in crowd} == {2} and {m[0]["content"] for m in crowd} == {bench.CHAT_SYSTEM}
    passages = [m[1]["content"].rsplit("\n\n", 1)[0] for m in crowd]
    assert {len(p.split()) for p in passages} == {bench.CROWD_WORDS} and len(set(passages)) == 9
    chat = {t.split("\n\n")[0][:200] for u in range(bench_serve.USERS)
            for t in bench.chat_turns(u, bench_serve.CHAT_TURNS)}
    assert not {p[:200] for p in passages} & chat   # no chat turn opens with a chat8 passage
    assert bench.crowd_messages(0, tag=" (run x)")[0]["content"] == bench.CHAT_SYSTEM + " (run x)"
    with pytest.raises(ValueError):
        bench.crowd_messages(len(bench.PROSE))


# ------------------------------------------------------------------------------------------------ clients, faked
class FakeClient:
    """Answers every streamed request after `delay` seconds with a piece of text and OpenAI's usage (and a KL when
    kv_check is asked); logs ("ask", max_tokens, kv_check) and counts the requests in flight at once."""

    def __init__(self, log: list, delay: float = 0.05):
        self.log, self.delay, self.lock, self.flying, self.most = log, delay, threading.Lock(), 0, 0
        self.chat = SimpleNamespace(completions=SimpleNamespace(with_raw_response=self))

    def create(self, *, messages, max_tokens, extra_body=None, **kw):
        with self.lock:
            self.log.append(("ask", max_tokens, bool(extra_body)))
            self.flying += 1
            self.most = max(self.most, self.flying)
        time.sleep(self.delay)
        with self.lock:
            self.flying -= 1
        piece = SimpleNamespace(choices=[SimpleNamespace(delta=SimpleNamespace(content=f"{len(messages)}"))],
                                usage=None, model_extra={})
        usage = SimpleNamespace(prompt_tokens=10, completion_tokens=max_tokens,
                                prompt_tokens_details=SimpleNamespace(cached_tokens=4))
        end = SimpleNamespace(choices=[], usage=usage,
                              model_extra={"kv_cache": {"first_token_kl": 0.01}} if extra_body else {})
        return SimpleNamespace(headers={"x-queue-seconds": "0.0"}, parse=lambda: [piece, end])


@pytest.fixture
def fake(monkeypatch):
    """bench's client and /health faked: (the log of requests and /health calls, in order; the client)."""
    log = []
    client = FakeClient(log)
    monkeypatch.setattr(bench, "client_for", lambda url, key=None: client)
    monkeypatch.setattr(bench, "health", lambda url: log.append(("health",)) or {"queued": 0, "store_jobs": 0})
    return log, client


def test_only_a_warm_up_waits_for_health_never_a_timed_request(fake):
    """Each workload's requests and /health calls in order: the warm-up, one wait for idle, then the timed requests
    with no look at /health among them (and after them only untimed kv_check requests)."""
    log, client = fake
    ask, health, warm = ("ask", 3, False), ("health",), ("ask", 1, False)

    def logged(fn, **kw):
        log.clear()
        r = fn("s", "u", "m", max_tokens=3, **kw)
        assert r.errors == 0
        return r, list(log)

    r, seen = logged(bench.run_chat8, users=3)
    assert seen == [warm, health, ask, ask, ask, ask] and len(r.samples) == 3 and r.alone.ttft_s
    r, seen = logged(bench.run_rag, users=2, requests=4, items=2, docs=4, words=20, kv_checks=1)
    assert seen == [warm, warm, health, ask, ask, ask, ask, ("ask", 1, True)] and r.kls == [0.01]
    r, seen = logged(bench.run_repeat, item=2, docs=4, words=20)
    assert seen == [health, ask, ask] and len(r.samples) == 2
    r, seen = logged(bench.run_reorder, item=3, docs=4, words=20)
    assert seen == [health, health, ask, ask, ("ask", 3, True)] and r.kls == [0.01]   # idle; is it ours (kv_check)
    r, seen = logged(bench.run_chat, users=2, turns=3)
    assert seen == [warm, health] + [ask] * 6
    assert sorted(int(s.text) for s in r.samples) == [2, 2, 4, 4, 6, 6]   # system, the conversation so far


def test_users_send_at_once_and_each_back_to_back(fake):
    """chat8's crowd all in flight at once after the lone request; rag's users at once, each user's next request
    the moment its answer ends (4 requests of 2 users: never more than 2 in flight); repeat one at a time."""
    _, client = fake
    r = bench.run_chat8("s", "u", "m", users=4, max_tokens=2)
    assert client.most == 4 and r.wall_s >= client.delay
    client.most = 0
    r = bench.run_rag("s", "u", "m", users=2, requests=4, items=2, max_tokens=2, docs=4, words=20)
    assert client.most == 2 and [(s.user, s.turn) for s in r.samples] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert r.wall_s >= 2 * client.delay
    client.most = 0
    bench.run_repeat("s", "u", "m", max_tokens=2, item=2, docs=4, words=20)
    assert client.most == 1


# ------------------------------------------------------------------------------------------------ tables, ratios
def sample(ttft, user=0, turn=0, text="a", kl=None, workload="w"):
    return bench.Sample(workload, user, turn, ttft, (ttft or 0) + 0.5, 100, 50, 4, text, None if ttft else "Err", kl=kl)


def run(server, workload, ttfts, wall=1.0, kls=(), alone=None):
    return bench.Run(server, workload, len(ttfts), [sample(t, u, workload=workload) for u, t in enumerate(ttfts)],
                     wall, list(kls), alone)


def made_up() -> list:
    return [run("store", "chat8", [0.5, 0.9, 1.2, 2.0], wall=10.0, alone=sample(0.5)),
            run("serial", "chat8", [0.5, 1.0, 1.5, 2.0], wall=40.0, alone=sample(0.5)),
            run("store", "repeat", [2.0, 0.2]),
            bench.Run("store", "reorder", 1, [sample(2.0, 0, 0), sample(0.1, 0, 1), sample(0.9, 0, 2, kl=0.02)], 3.0,
                      [0.02]),
            run("store", "rag", [1.0, 2.0, 3.0, 4.0]), run("no_store", "rag", [5.0, 6.0, 7.0, 8.0])]


def test_ratios_are_the_criteria_from_the_runs():
    r = bench.ratios(made_up())
    assert set(r) == {key for key, _, _ in bench.CRITERIA}
    assert r["chat8_last_over_lone"] == 4.0 and r["chat8_wall_store_over_serial"] == 0.25
    assert r["repeat_again_over_first"] == pytest.approx(0.1) and r["reorder_over_first"] == pytest.approx(0.45)
    assert r["reorder_first_token_kl"] == 0.02 and r["rag_p50_store_over_no_store"] == pytest.approx(2.0 / 6.0)
    missing = bench.ratios(made_up()[2:])   # no chat8 run: those two are missing, never a crash
    assert missing["chat8_last_over_lone"] is None and missing["chat8_wall_store_over_serial"] is None


def test_the_tables_and_ratios_block_print_from_made_up_runs(capsys):
    runs = made_up()
    page = Page("bench_serve", "test", "§7", plot=False)
    a = SimpleNamespace(max_tokens=4)
    sp.show_bench(page, runs, [BenchServer(role) for role in ("store", "serial", "no_store")], a)
    sp.show_sequences(page, runs)
    floors = {"tokens": 1251, "prefill_s": 2.5, "decode_step_s": 0.047, "last_over_lone": 5.0,
              "wall_over_serial": 0.3}
    sp.show_ratios(page, bench.ratios(runs), {"no_store": "RuntimeError: did not start"}, floors)
    out = capsys.readouterr().out
    ratios = page.tables[-1]
    cells = {row.cells[0]: row.cells[1:] for row in ratios.rows}
    assert cells[bench.CRITERIA[0][1]] == ["4.00x", "<= 4x", "yes", "5.00x"]
    assert cells[bench.CRITERIA[1][1]] == ["0.25x", "<= 0.35x", "yes", "0.30x"]
    assert cells[bench.CRITERIA[3][1]] == ["0.45x", "<= 0.4x", "no", "-"]
    assert cells[bench.CRITERIA[4][1]] == ["0.020", "-", "-", "-"]
    assert "no_store did not run: RuntimeError: did not start" in out
    assert "products of the crowd's 1,251 prompt tokens past the system message took 2.50 s on this core, and of a " \
        "decode step of one answer 47 ms" in " ".join(ratios.notes)
    main = page.tables[0]
    assert len(main.rows) == len(runs) and "chat8, one short request; repeat, nothing; reorder, nothing; rag, each " \
        "item's documents once, in their first order. Then the client waited" in " ".join(main.notes)
    seq = {(r.cells[0], r.cells[2]): r.cells[3:5] for r in page.tables[1].rows}
    assert seq["store", "one request alone"] == ["0.50", "1.00"]
    assert seq["store", "the same, reordered"] == ["0.90", "0.45"]
    assert sp.sequences(runs)["chat8"]["store"]["last_over_lone"] == 4.0


def test_the_page_and_json_say_what_each_server_reuses_from_its_bench_server():
    """serving/page.py's bench_serve section on made-up runs with ours at another ratio: the first table's notes,
    the quality table and --json take each server's name and reuse from its BenchServer; --json holds every run
    by server and workload (chat8 as "concurrent"), the answers against no_store's, the targets and the failures."""
    runs = made_up() + [run("store@0.6", "rag", [1.5, 2.5])]
    servers = [BenchServer("store", bench_serve.WORKLOADS), BenchServer("serial", ("chat8",)),
               BenchServer("no_store", bench_serve.WORKLOADS), BenchServer("store", ("rag",), ratio=0.6)]
    page = Page("bench_serve", "test", "§7", plot=False)
    a = SimpleNamespace(max_tokens=4, users=2, chat8_users=3, threads=1)
    sp.show_bench(page, runs, servers, a)
    sp.show_quality(page, runs, servers, bench_serve.RATIO)
    notes = " ".join(page.tables[0].notes)
    assert "store@0.6: reuses what store reuses, 60% recomputed (serve.py --ratio 0.6)." in notes
    assert f"store: reuses {REUSES['store']}." in notes and f"no_store: reuses {REUSES['no_store']}." in notes
    quality = page.tables[1]
    assert [r.cells[:2] for r in quality.rows] == [["store", REUSE_SHORT["store"]],
                                                   ["store@0.6", "exact prefix; chunks blended, 60% recomputed"]]
    assert "ours recomputes 15% of a blended document's tokens" in " ".join(quality.notes)
    data = json.loads(json.dumps(sp.bench_json(a, runs, [], servers, bench.ratios(runs), None, {"x": "why"})))
    names = ["store", "serial", "no_store", "store@0.6"]
    assert data["reuses"] == {s.name: s.reuses() for s in servers} and list(data["reuses"]) == names
    assert data["threads"] == dict.fromkeys(names, 1) and data["failed"] == {"x": "why"}
    assert set(data["store"]) == {"concurrent", "repeat", "reorder", "rag"}
    assert data["store@0.6"] == {"rag": json.loads(json.dumps(runs[-1].summary()))}
    assert data["same_answer"]["store@0.6/rag"] == 1.0 and data["chat8"]["store"]["last_over_lone"] == 4.0
    assert [q["server"] for q in data["rag_quality"]] == ["store", "store@0.6"]
    assert data["ratios"]["chat8_last_over_lone"] == {"value": 4.0, "target": 4, "met": True, "floor": None}
    assert data["vllm_client"] == [] and data["chat8_floor"] is None
    assert set(data) == set(sp.JSON_KEYS) | set(names)   # parse refuses a --url NAME among JSON_KEYS


# ------------------------------------------------------------------------------------------------ --blend-ratio
def test_blend_ratios_start_ours_at_each_ratio_for_rag_alone():
    """--blend-ratio R starts ours with `--ratio R` as store@R, which runs rag alone (its quality row); store's own
    ratio and a repeated R start nothing more, and a workload list without rag starts none."""
    import importlib as il
    assert bench_serve.RATIO == il.import_module("lecture27.serve").RATIO   # two programs, one ratio
    a = bench_serve.parse(["--blend-ratio", "0.6", "--blend-ratio", "1", "--blend-ratio", "0.6", "--blend-ratio",
                           "0.15", "--no-plot"])
    got = {s.name: s for s in bench_serve.servers(a)}
    assert list(got) == ["store", "no_store", "serial", "store@0.6", "store@1"]
    assert got["store@0.6"].workloads == ("rag",) and got["serial"].workloads == ("chat8",)
    assert got["store"].workloads == a.workloads
    argv = got["store@0.6"].process.argv
    assert argv[argv.index("--ratio") + 1] == "0.6" and "--ratio" not in got["store"].process.argv
    assert (got["store@0.6"].role, got["store@0.6"].ratio, got["store"].ratio) == ("store", 0.6, None)
    assert [s.only_ours for s in got.values()] == [False, True, True, True, True]
    none = bench_serve.parse(["--blend-ratio", "0.6", "--workload", "chat8", "--no-plot"])
    assert [s.name for s in bench_serve.servers(none)] == ["store", "no_store", "serial"]
    vllm_client_only = bench_serve.parse(["--blend-ratio", "0.6", "--no-plot"])
    vllm_client_only.clients = ("vllm",)   # vLLM's client runs no server started for our client's comparisons
    assert [s.name for s in bench_serve.servers(vllm_client_only)] == ["store"]


def test_a_server_is_named_and_says_what_it_reuses_from_its_fields():
    """A BenchServer's name and reuse come from its fields: ours at another ratio is store@R and reuses store's at
    R; a --url server keeps its NAME (server<i> for a bare URL) and URL, and is a peer by its NAME alone; a NAME that
    reads like store@R is only a name (no ratio is read back out of it)."""
    at = BenchServer("store", ("rag",), ratio=0.3)
    assert at.name == "store@0.3" and at.reuses(short=True) == "exact prefix; chunks blended, 30% recomputed"
    assert at.reuses() == "what store reuses, 30% recomputed (serve.py --ratio 0.3)" and at.full_prefill is None
    assert BenchServer("store", ratio=1.0).name == "store@1" and BenchServer("store").reuses() == REUSES["store"]
    a = bench_serve.parse(["--url", "store@0.6=http://h:1/v1", "--url", "http://h:2/v1?x=a=b", "--url",
                           "vllm=http://h:3/v1", "--no-plot"])
    given = bench_serve.servers(a)
    assert [(s.name, s.url, s.ratio, s.peer, s.process, s.only_ours) for s in given] == [
        ("store@0.6", "http://h:1/v1", None, False, None, False),
        ("server2", "http://h:2/v1?x=a=b", None, False, None, False),
        ("vllm", "http://h:3/v1", None, True, None, False)]
    assert all(s.workloads == a.workloads for s in given)
    assert given[0].reuses() == "whatever it reuses" and given[0].reuses(short=True) == "?"
    assert given[2].full_prefill is REFERENCE["vllm"] and given[2].reuses(short=True) == "exact prefix"


def test_a_bench_server_starts_and_stops_only_a_process_of_its_own():
    """start() starts a server started here and gives its URL once it listens; leaving its with block stops it,
    whatever ended the block. A server given by --url is neither started nor stopped."""
    class Process:
        url, events = None, []

        def start(self):
            self.events.append("start")
            self.url = "http://127.0.0.1:1/v1"

        def stop(self):
            self.events.append("stop")
    ours = BenchServer("store", process=Process())
    with pytest.raises(KeyError), ours:
        assert ours.url is None and ours.start() == ours.url == "http://127.0.0.1:1/v1"
        raise KeyError("a workload's failure")
    assert Process.events == ["start", "stop"]
    given = BenchServer("store", given_url="http://h:1/v1")
    with given:
        assert given.start() == "http://h:1/v1"


def test_a_blend_ratio_outside_0_1_or_beside_url_is_one_line_and_exit_2(capsys):
    for argv in (["--blend-ratio", "1.5"], ["--blend-ratio", "0.6", "--url", "http://127.0.0.1:8000/v1"]):
        with pytest.raises(SystemExit) as e:
            bench_serve.parse([*argv, "--no-plot"])
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and len(err.splitlines()) <= 2 and "--blend-ratio" in err, err


def test_the_quality_table_sets_each_ratio_beside_no_stores_answers():
    def rag(server, texts, ttft):
        return bench.Run(server, "rag", 1, [sample(ttft, 0, t, x, workload="rag") for t, x in enumerate(texts)], 1.0)
    servers = [BenchServer("store"), BenchServer("no_store"), BenchServer("store", ratio=0.6),
               BenchServer("store", ratio=1.0)]
    runs = [rag(s.name, texts, ttft) for s, texts, ttft in zip(servers, ("abcd", "abxy", "abcy", "abxy"),
                                                                 (1.0, 4.0, 2.0, 4.0))]
    q = {x["server"]: x for x in sp.rag_quality(runs, servers)}
    assert [x["server"] for x in sp.rag_quality(runs, servers)] == ["store", "store@0.6", "store@1"]
    assert (q["store"]["same_answer"], q["store@0.6"]["same_answer"], q["store@1"]["same_answer"]) == (0.5, 0.75, 1.0)
    assert q["store@0.6"]["reuses"] == "exact prefix; chunks blended, 60% recomputed"
    assert q["store@1"]["reuses"] == "exact prefix; chunks blended, 100% recomputed"
    assert q["store@0.6"]["ttft_p50_s"] == 2.0 and "no_store" in q["store@0.6"]["against"]
    assert servers[2].reuses() == "what store reuses, 60% recomputed (serve.py --ratio 0.6)"


# ------------------------------------------------------------------------------------------------ chat8's floor
def test_the_floors_products_are_every_linear_layer_at_the_rows_asked():
    """product_seconds runs each block's seven linear layers on `rows` rows (a layer left out, the floor would be too
    low) and the head on `head_rows`, packed weights or not."""
    from common.llama import Llama, LlamaConfig
    from lecture27.engine import runner
    model = Llama(LlamaConfig(vocab_size=40, n_layers=2)).eval()
    for m in (model, runner.packed(model)):
        seen = []
        for blk in m.layers:
            for name in runner.LINEARS:
                getattr(blk, name).register_forward_hook(lambda mod, args, out, name=name: seen.append(
                    (name, args[0].shape[0])))
        head_rows = []
        logits = m.logits
        m.logits = lambda x: head_rows.append(x.shape[0]) or logits(x)
        assert floor.product_seconds(m, 5, 2, repeats=1) > 0
        assert sorted(seen) == sorted([(name, 5) for name in runner.LINEARS] * 2 * 2)   # 2 layers, 2 calls
        assert head_rows == [2, 2]


def test_the_floor_is_the_products_over_the_measured_times(monkeypatch):
    """last / lone >= P(crowd tokens) / lone TTFT; wall >= (P(crowd tokens) + (answer tokens - 1) P(one decode row))
    / serial wall; a missing time gives no floor."""
    monkeypatch.setattr(floor, "product_seconds", lambda model, rows, head_rows: rows / 1000 + head_rows / 1e6)
    f = floor.chat8_floor(None, 1200, 8, 16, 0.5, 10.0)
    assert f["tokens"] == 1200 and f["prefill_s"] == pytest.approx(1.2 + 8e-6)
    assert f["decode_step_s"] == pytest.approx(0.001 + 1e-6)   # one row: the last answer, token by token
    assert f["last_over_lone"] == pytest.approx(f["prefill_s"] / 0.5)
    assert f["wall_over_serial"] == pytest.approx((f["prefill_s"] + 15 * f["decode_step_s"]) / 10.0)
    none = floor.chat8_floor(None, 1200, 8, 16, None, None)
    assert none["last_over_lone"] is None and none["wall_over_serial"] is None


def test_the_decode_floor_reads_every_weight_and_the_step_is_the_engines(monkeypatch):
    """weights_read_seconds touches every parameter of the model (the head's too: a weight left out, the floor would
    be too low); decode_profile times runner.run's decode step of `rows` requests, each row one token behind its
    cache, and splits it into the products and the rest."""
    from common.llama import Llama, LlamaConfig
    from lecture27.engine import decode_floor, runner
    model = Llama(LlamaConfig(vocab_size=40, n_layers=2, tie_embeddings=False)).eval()
    read = []
    real_sum = torch.Tensor.sum
    monkeypatch.setattr(torch.Tensor, "sum", lambda t, *a, **k: read.append(t.data_ptr()) or real_sum(t, *a, **k))
    assert decode_floor.weights_read_seconds(model, repeats=1) > 0
    monkeypatch.setattr(torch.Tensor, "sum", real_sum)
    assert set(read) == {p.data_ptr() for p in model.parameters()} and model.head.weight.data_ptr() in read
    steps = []
    real_run = runner.run
    monkeypatch.setattr(runner, "run", lambda m, items: steps.append([len(it.tokens) for it in items])
                        or real_run(m, items))
    r = decode_floor.decode_profile(model, 3, context=10, steps=2)
    assert [n for n in steps if n == [1, 1, 1]] and r["rows"] == 3
    assert r["rest_s"] == pytest.approx(r["step_s"] - r["products_s"])
    assert r["over_floor"] == pytest.approx(r["step_s"] / r["floor_s"])


def test_no_floor_without_our_chat8_run():
    """A --url run (its server's model is not known here) and a run without store's chat8 time no products."""
    runs = made_up()
    assert bench_serve.chat8_floor(SimpleNamespace(url=["store=http://x/v1"]), runs) is None
    assert bench_serve.chat8_floor(SimpleNamespace(url=[]), runs[1:]) is None


@pytest.mark.real_model
def test_chat8_floor_on_smollm2_counts_the_crowds_own_tokens():
    """SmolLM2's floor for 2 users: their prompts past the system message (about 150-170 tokens each), products of a
    prefill longer than a decode step's, the ratios against the runs' times."""
    from common.gguf_llama import find_smollm2_gguf
    if find_smollm2_gguf() is None:
        pytest.skip("SmolLM2 is not installed")
    runs = made_up()
    a = SimpleNamespace(url=[], threads=1, chat8_users=2, max_tokens=3)
    f = bench_serve.chat8_floor(a, runs)
    assert 2 * 140 <= f["tokens"] <= 2 * 180
    assert f["prefill_s"] > f["decode_step_s"] > 0
    assert f["last_over_lone"] == pytest.approx(f["prefill_s"] / 0.5)   # made_up's lone TTFT: 0.5 s
    assert f["wall_over_serial"] == pytest.approx((f["prefill_s"] + 2 * f["decode_step_s"]) / 40.0)


# ------------------------------------------------------------------------------------------------ the real engine
@pytest.mark.real_model
@pytest.mark.server
def test_every_workload_tiny_on_the_real_engine(tmp_path, capsys):
    """Our engine started as a server, every workload at 2 users and 2 answer tokens: the tables print, no request
    fails, --json holds each figure."""
    from common.gguf_llama import find_smollm2_gguf
    if find_smollm2_gguf() is None:
        pytest.skip("SmolLM2 is not installed")
    out = tmp_path / "bench.json"
    with launch.engine() as server:
        runs = bench_serve.main(["--url", f"store={server.url}", "--chat8-users", "2", "--users", "2",
                                 "--rag-requests", "2", "--rag-items", "1", "--docs", "4", "--doc-words", "30",
                                 "--chat-turns", "2", "--max-tokens", "2", "--no-plot", "--json", str(out)])
    text = capsys.readouterr().out
    assert [r.workload for r in runs] == list(bench_serve.WORKLOADS)
    assert all(r.errors == 0 and r.p(0.5) for r in runs), [(r.workload, r.errors) for r in runs]
    data = json.loads(out.read_text())
    assert set(data["chat8"]["store"]) >= {"lone_ttft_s", "last_first_token_s", "last_over_lone", "wall_s"}
    assert data["reorder"]["store"]["first_token_kl"] is not None and data["failed"] == {}
    assert data["ratios"]["repeat_again_over_first"]["value"] > 0
    assert data["ratios"]["chat8_wall_store_over_serial"] == {"value": None, "target": 0.35, "met": None,
                                                              "floor": None}   # no serial; no floor for a --url
    assert data["chat8_floor"] is None
    # the spec's keys: {server: {workload: figures}} (chat8 as "concurrent"), what each server reuses, its threads
    assert set(data["store"]) == {"concurrent", "rag", "rag1", "repeat", "reorder", "chat"}
    assert all(set(figures) >= {"ttft_p50_s", "ttft_p99_s", "wall_s", "tokens_per_s", "errors", "cached_share"}
               for figures in data["store"].values())
    assert data["store"]["repeat"]["errors"] == 0 and data["store"]["concurrent"]["ttft_p50_s"] > 0
    assert data["reuses"] == {"store": REUSES["store"]} and data["threads"] == {"store": 1}
    assert "the engine's targets" in text and "one request alone" in text


def test_the_serde_workload_runs_only_when_named_on_servers_of_its_own():
    from lecture27.serving import serde
    assert bench_serve.parse(["--workload", "serde"]).workloads == ()
    assert bench_serve.parse(["--workload", "rag", "--workload", "serde"]).workloads == ("rag",)
    assert "serde" not in bench_serve.parse([]).workloads
    assert serde.run_for(bench_serve.parse(["--workload", "rag"])) is None


STAND_IN = """
import socket, sys, time
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen()
print(f"serving stand-in at http://127.0.0.1:{s.getsockname()[1]}/v1", flush=True)
conn, _ = s.accept()          # a client's request: never answered while the server runs
time.sleep(600)
"""

OWNER = """
import socket, sys, threading
from concurrent.futures import ThreadPoolExecutor
from lecture27.serving import launch
server = launch.Server([sys.executable, "-c", sys.argv[1]]).start()
port = int(server.url.rsplit(":", 1)[1].split("/")[0])

connected = threading.Semaphore(0)

def client(_):                # a client waiting on an answer that never comes, as a benchmark's users do
    c = socket.create_connection(("127.0.0.1", port))
    connected.release()
    c.recv(1)
with server:
    with ThreadPoolExecutor(2) as pool:   # its exit waits for the clients, before the server's with can stop it
        waiting = pool.map(client, range(2))
        connected.acquire(); connected.acquire()
        print(server.pid, flush=True)
        list(waiting)
"""


@pytest.mark.parametrize("how", ("sigterm", "sigkill"))
def test_a_server_ends_with_its_owner_even_while_a_client_waits_on_it(how):
    """SIGTERM to the program that started a server (launch.Server): the server gets it at once, so the client
    thread waiting on it returns and the program ends within seconds; SIGKILL: the kernel's parent-death signal
    ends the server (Linux)."""
    import os
    import signal
    import subprocess
    import sys

    from common import files
    if how == "sigkill" and not sys.platform.startswith("linux"):
        pytest.skip("the parent-death signal is Linux's")
    p = subprocess.Popen([sys.executable, "-c", OWNER, STAND_IN], stdout=subprocess.PIPE, text=True)
    pid = int(p.stdout.readline())
    try:
        assert files.pid_alive(pid)
        p.send_signal(signal.SIGTERM if how == "sigterm" else signal.SIGKILL)
        p.wait(timeout=10)
        deadline = time.monotonic() + 10
        while files.pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not files.pid_alive(pid), f"the server outlived its owner ({how})"
    finally:
        p.kill()
        if files.pid_alive(pid):
            os.kill(pid, signal.SIGKILL)
    assert p.returncode == (128 + signal.SIGTERM if how == "sigterm" else -signal.SIGKILL)
