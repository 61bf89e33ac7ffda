"""tiers.py (capacity, LRU, hints, write-through, copy-up, longest prefix) and 05_tiered_storage.py
(the chat simulation, the narrow-waist experiment, the command line)."""
import importlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from lecture27.tiers import SimTier, TieredStore

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "code" / "lecture27" / "05_tiered_storage.py"


ts = importlib.import_module("lecture27.05_tiered_storage")
tst = importlib.import_module("lecture27.store.tiers_study")    # 05's computing


# ------------------------------------------------------------------------------------- tiers.py
@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 30), st.integers(1, 40), st.booleans()), max_size=200),
       st.integers(0, 100), st.booleans())
def test_capacity_never_exceeded(ops, capacity, hinted):
    tier = SimTier("t", capacity, hinted=hinted)
    sizes = {}
    for key, nbytes, reuse in ops:
        nbytes = sizes.setdefault(key, nbytes)   # a key always names the same bytes
        stored = tier.put(key, nbytes, reuse)
        assert stored == (nbytes <= capacity)
        assert tier.used <= capacity
        assert tier.used == sum(sizes[k] for k in tier.keys_lru_order())


class DictTier:
    """The obviously-correct model of a SimTier: one list in recency order (oldest first) of
    [key, nbytes, marked]; a victim is the oldest unmarked chunk, else the oldest marked one."""

    def __init__(self, capacity, hinted):
        self.capacity, self.hinted, self.items, self.evictions = capacity, hinted, [], 0

    def find(self, key):
        return next((i for i, it in enumerate(self.items) if it[0] == key), None)

    def touch(self, key):
        i = self.find(key)
        if i is None:
            raise KeyError(key)
        self.items.append(self.items.pop(i))

    def put(self, key, nbytes, reuse):
        if self.find(key) is not None:
            self.touch(key)
            return True
        if nbytes > self.capacity:
            return False
        while sum(it[1] for it in self.items) + nbytes > self.capacity:
            unmarked = [i for i, it in enumerate(self.items) if not it[2]]
            self.items.pop(unmarked[0] if unmarked else 0)
            self.evictions += 1
        self.items.append([key, nbytes, reuse and self.hinted])
        return True

    def order(self):
        return [it[0] for it in self.items if not it[2]] + [it[0] for it in self.items if it[2]]


@pytest.mark.parametrize("hinted", [False, True])
@settings(max_examples=100, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["put", "touch"]), st.integers(0, 12), st.integers(1, 9),
                               st.booleans()), max_size=120), capacity=st.integers(0, 30))
def test_tier_equals_a_dictionary_model(ops, capacity, hinted):
    """Any sequence of puts and touches: the same contents, eviction order, bytes and eviction count."""
    tier, model = SimTier("t", capacity, hinted=hinted), DictTier(capacity, hinted)
    sizes = {}
    for op, key, nbytes, reuse in ops:
        nbytes = sizes.setdefault(key, nbytes)
        if op == "put":
            assert tier.put(key, nbytes, reuse) == model.put(key, nbytes, reuse)
        elif key in tier:
            tier.touch(key)
            model.touch(key)
        else:
            with pytest.raises(KeyError):
                tier.touch(key)
            assert model.find(key) is None
        assert tier.keys_lru_order() == model.order()
        assert tier.used == sum(it[1] for it in model.items) and len(tier) == len(model.items)
        assert tier.evictions == model.evictions


def test_lru_order_and_touch():
    tier = SimTier("t", 3)
    for k in "abc":
        tier.put(k, 1)
    tier.touch("a")                      # b is now the least recently used
    tier.put("d", 1)
    assert "b" not in tier and set(tier.keys_lru_order()) == {"a", "c", "d"}
    assert tier.keys_lru_order() == ["c", "a", "d"]
    tier.put("c", 1)                     # writing a present chunk touches it
    tier.put("e", 1)
    assert "a" not in tier and tier.evictions == 2


def test_hint_keeps_marked_chunks():
    plain, hinted = SimTier("lru", 3), SimTier("hint", 3, hinted=True)
    for tier in (plain, hinted):
        tier.put("doc", 1, reuse=True)
        tier.put("x", 1)
        tier.put("y", 1)
        tier.put("z", 1)                 # full: someone must go
    assert "doc" not in plain            # LRU evicts the oldest, the document
    assert "doc" in hinted and "x" not in hinted


def test_write_through_and_copy_up():
    gpu, cpu, ssd = SimTier("gpu", 2), SimTier("cpu", 4, bandwidth=2.0), SimTier("ssd", 100, bandwidth=0.5)
    store = TieredStore([gpu, cpu, ssd])
    store.store(["a0", "a1"], [1, 1])
    assert all(k in t for k in ("a0", "a1") for t in (gpu, cpu, ssd))   # written through
    store.store(["b0", "b1"], [1, 1])
    store.store(["c0", "c1"], [1, 1])
    # GPU holds 2, CPU 4, SSD all: a is only on the SSD, b on CPU + SSD
    assert store.lookup(["a0", "a1"]) == [2, 2]
    assert store.lookup(["b0", "b1"]) == [1, 1]
    found = store.fetch(["a0", "a1", "zz"], [1, 1, 1])
    assert found.tier_of_chunk == [2, 2] and found.bytes_per_tier == [0, 0, 2]
    assert found.load_s == pytest.approx(2 / 0.5)                       # bytes / SSD bandwidth
    assert "a0" in gpu and "a1" in gpu and "a0" in cpu and "a1" in cpu   # copied up
    assert gpu.used <= gpu.capacity and cpu.used <= cpu.capacity


def test_longest_prefix_stops_at_first_gap_and_mixes_tiers():
    gpu, cpu = SimTier("gpu", 10), SimTier("cpu", 10, bandwidth=1.0)
    store = TieredStore([gpu, cpu])
    store.store(["p0", "p1", "p2", "p3"], [1] * 4)
    gpu.plain.pop("p1"); gpu.used -= 1           # p1 left the GPU but is still on the CPU
    cpu.plain.pop("p2"); cpu.used -= 1
    gpu.plain.pop("p2"); gpu.used -= 1           # p2 is nowhere: p3 is unreachable
    assert store.lookup(["p0", "p1", "p2", "p3"]) == [0, 1]
    found = store.fetch(["p0", "p1", "p2", "p3"], [1] * 4)
    assert found.load_s == pytest.approx(1.0)    # only p1 is loaded; p0 is already on the GPU


def test_a_lookup_by_content_goes_on_past_a_gap():
    store = TieredStore([SimTier("gpu", 10), SimTier("cpu", 100, bandwidth=2.0)])
    store.store(["a", "c"], [1, 1])
    assert store.lookup(["a", "b", "c"]) == [0]
    assert store.lookup(["a", "b", "c"], prefix=False) == [0, None, 0]
    found = store.fetch(["b", "c", "a"], [1, 1, 1], prefix=False)
    assert found.tier_of_chunk == [None, 0, 0] and found.n_chunks == 2 and found.bytes_per_tier == [2, 0]


def test_a_prefix_is_evicted_from_its_tail():
    tier = SimTier("gpu", 3)
    store = TieredStore([tier])
    store.store(["h0", "h1", "h2"], [1, 1, 1])
    tier.put("other", 1)                        # one chunk must go: the tail h2, not the head h0
    assert store.lookup(["h0", "h1", "h2"]) == [0, 0]


def test_a_fetched_prefix_is_touched_tail_first_so_its_head_is_evicted_last():
    tier = SimTier("gpu", 4)
    store = TieredStore([tier])
    store.store(["h0", "h1", "h2"], [1, 1, 1])
    tier.put("x", 1)                            # x is now the most recent
    store.fetch(["h0", "h1", "h2"], [1, 1, 1])  # the prompt again: its chunks, head most recent of all
    assert tier.keys_lru_order() == ["x", "h2", "h1", "h0"]


# ------------------------------------------------------------------------- the chat simulation
SMALL = dict(users=30, turns=6, rate=20.0, seed=3)
SERVE = dict(model=ts.MODEL, gpu=ts.GPU, user_tokens=ts.USER_TOKENS, answer_tokens=ts.ANSWER_TOKENS, chunk=ts.CHUNK)


def small_configs():
    # scaled down: 30 users x 6 turns x 768 tokens x 128 KiB = 18 GB of history in all
    return tst.chat_configs(gpu_gb=3.0, cpu_gb=10.0, cpu_small_gb=2.5, slow=ts.CPU_SLOW_GBPS, fast=ts.CPU_FAST_GBPS,
                           ssd_gb=100.0, ssd_gbps=ts.SSD_GBPS)


def run(name, seed=3):
    trace = tst.chat_trace(**{**SMALL, "seed": seed})
    return trace, tst.serve(trace, tst.make_store(small_configs()[name]), **SERVE)


def test_every_request_completes_once_in_order():
    (arrival, user, turn), r = run("cpu_slow")
    n = SMALL["users"] * SMALL["turns"]
    assert len(arrival) == len(r.finish) == n
    assert len(set(zip(user.tolist(), turn.tolist()))) == n              # each (user, turn) once
    for u in range(SMALL["users"]):                                      # turns in order per user
        assert turn[user == u].tolist() == list(range(SMALL["turns"]))
    assert np.all(np.diff(r.start) >= 0) and np.all(r.start >= arrival)  # FCFS
    assert np.all(r.start[1:] >= r.finish[:-1] - 1e-12)                  # one GPU: no overlap


def test_ttft_covers_load_and_compute():
    for name in ("gpu_only", "cpu_slow", "cpu_ssd"):
        _, r = run(name)
        assert np.all(r.ttft >= r.load_s + r.compute_s - 1e-12)
        assert np.all(r.compute_s > 0) and np.all(r.recompute_s <= r.compute_s + 1e-12)


def test_tiers_hit_more_than_gpu_only():
    res = {name: run(name)[1] for name in ("gpu_only", "cpu_slow", "cpu_fast", "cpu_ssd")}
    assert res["gpu_only"].hit_rate < res["cpu_slow"].hit_rate <= res["cpu_ssd"].hit_rate
    assert res["cpu_slow"].hit_rate == res["cpu_fast"].hit_rate          # bandwidth changes time only
    assert res["cpu_fast"].mean_ttft_s < res["cpu_slow"].mean_ttft_s
    assert res["cpu_ssd"].hit_rate == pytest.approx(1.0)                 # the SSD holds everything
    assert res["gpu_only"].load_s.sum() == 0


def test_small_write_through_tier_adds_nothing():
    # inclusion: an LRU tier no bigger than the GPU's, written through, never holds what the GPU lacks
    trace = tst.chat_trace(**SMALL)
    base = tst.serve(trace, tst.make_store(small_configs()["gpu_only"]), **SERVE)
    small = tst.serve(trace, tst.make_store(small_configs()["cpu50"]), **SERVE)
    assert small.hit_rate_per_tier[1] == 0 and small.mean_ttft_s == base.mean_ttft_s


def test_same_seed_same_numbers():
    _, a = run("cpu_ssd", seed=5)
    _, b = run("cpu_ssd", seed=5)
    _, c = run("cpu_ssd", seed=6)
    assert np.array_equal(a.ttft, b.ttft) and a.hit_rate_per_tier == b.hit_rate_per_tier
    assert not np.array_equal(a.ttft, c.ttft)


DOCS = dict(doc_tokens=ts.DOC_TOKENS, oneshot_tokens=ts.ONESHOT_TOKENS, chunk=ts.CHUNK, model=ts.MODEL)


def test_hint_hits_at_least_as_often_as_lru():
    for seed in (0, 1):
        docs = tst.doc_trace(600, ts.DOCS, ts.ONESHOT_SHARE, seed)
        lru = tst.doc_hit_rate(docs, False, ts.DOC_CACHE_GB, **DOCS)
        hinted = tst.doc_hit_rate(docs, True, ts.DOC_CACHE_GB, **DOCS)
        assert hinted >= lru and hinted > 0.9 and lru < 0.8
    docs = tst.doc_trace(600, ts.DOCS, ts.ONESHOT_SHARE, 0)
    assert tst.doc_hit_rate(docs, True, 100, **DOCS) == tst.doc_hit_rate(docs, False, 100, **DOCS)


def test_handoff_paths_are_sums_of_hops():
    h = tst.handoff_paths(ts.HANDOFF_MODEL, ts.HANDOFF_TOKENS, ts.PCIE_GBPS, ts.MEMCPY_GBPS, ts.NET_GBPS)
    assert h.nbytes == 16_000 * 327_680
    for r in h.routes.values():
        assert r.seconds == pytest.approx(sum(h.nbytes / (bw * 1e9) for _, _, bw in r.hops))
    s = {k: r.seconds for k, r in h.routes.items()}
    assert s["shared_pool"] < s["library_copy"] and s["shared_pool"] < s["remote_pool"]


# ---------------------------------------------------------------------------- the command line
@pytest.mark.slow
def test_script_json(tmp_path):
    out = tmp_path / "o.json"
    r = subprocess.run([sys.executable, str(SCRIPT), "--no-plot", "--json", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    d = json.loads(out.read_text())
    assert set(d["handoff_s"]) == {"remote_pool", "library_copy", "shared_pool"}
    c = d["configs"]
    for name in ("gpu_only", "cpu_slow", "cpu_fast", "cpu_ssd"):
        assert {"hit_rate", "mean_ttft_s", "p99_ttft_s"} <= set(c[name])
    # the handout's shape: GPU only collapses, each tier helps, fast beats slow severalfold
    assert c["gpu_only"]["mean_ttft_s"] > 5 * c["cpu_slow"]["mean_ttft_s"]
    assert c["cpu_slow"]["mean_ttft_s"] > c["cpu_fast"]["mean_ttft_s"] > c["cpu_ssd"]["mean_ttft_s"]
    assert 3 < c["cpu_slow"]["mean_ttft_s"] / c["cpu_fast"]["mean_ttft_s"] < 10
    assert 0.3 < d["lru_doc_hit_rate"] < 0.6 and d["hinted_doc_hit_rate"] > 0.95


@pytest.mark.parametrize("args", [["--rate", "-1"], ["--turns", "0"], ["--cpu-gb", "x"], ["--bogus"]])
def test_bad_flag_one_line_exit_2(args, cli_exit):
    code, err = cli_exit("05_tiered_storage", *args)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
