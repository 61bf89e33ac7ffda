"""The KV ledger (ledger.py) against the handout's §1 figures and exercises 1-2."""
import pytest

from lecture27 import ledger
from common import timemodel as tm

K = 1024


def test_32k_context_of_70b_is_10_7_gb():  # exercise 1
    assert ledger.kv_bytes("llama-3.1-70b", 32 * K, 2) / 1e9 == pytest.approx(10.7, abs=0.05)


def test_gpu_day_is_15_9_tb():  # slides p.8: MI300X, DeepSeek-R1, 2,625 tok/s
    assert round(ledger.gpu_day_bytes("deepseek-r1", 2625, 2) / 1e12, 1) == 15.9


@pytest.mark.parametrize("n", [4 * K, 8 * K, 16 * K, 32 * K, 64 * K])
def test_breakeven_bandwidth_4_to_6_gbytes_per_s(n):
    assert 4e9 <= ledger.breakeven_bandwidth("llama-3.1-70b", "H100", n, 8, 2) <= 6e9


def test_exercise2_threshold_14_4_gbit_per_s():
    thr = ledger.breakeven_bandwidth("llama-3.1-70b", "H100", 16 * K, 8, 2, compression=3)
    assert thr * 8 / 1e9 == pytest.approx(14.4, rel=0.05)
    assert thr == pytest.approx(ledger.breakeven_bandwidth("llama-3.1-70b", "H100", 16 * K, 8, 2) / 3)


def test_tiers_cross_cloud_loses_cpu_wins():
    rows = ledger.fetch_or_recompute("llama-3.1-70b", "H100", 8, [4 * K, 16 * K, 64 * K], 2)
    for r in rows:
        assert r.fetch_s["cross-cloud 10 Gb/s"] > r.recompute_s  # handout §1.4
        assert r.fetch_s["CPU DRAM"] < r.recompute_s / 5
        assert r.fetch_s["RDMA network"] < r.recompute_s / 5
        assert r.kv_bytes == 327_680 * r.context


SLIDES = dict(gpu_hour_usd=2.0, gpus_per_node=8, storage_tb_per_node=1.0, storage_usd_per_tb_hour=0.15,
              hit_saves=0.88, hit_rate=0.10, nodes=1000, years=3)


def test_slides_economics_within_5_percent():
    e = ledger.slides_economics(**SLIDES)
    assert e.breakeven_if_hit_saves_all == pytest.approx(0.15 / 16)
    assert e.breakeven_hit_rate * 100 == pytest.approx(1.06, rel=0.05)
    assert e.net_usd / 1e6 == pytest.approx(33, rel=0.05)                        # §1.3
    assert e.storage_usd / 1e6 == pytest.approx(4, rel=0.05)
    assert e.net_if_33m_read_as_gross_usd / 1e6 == pytest.approx(29, rel=0.05)   # navigation
    # by hand: 3 years = 26,280 h; 1,000 nodes x 8 GPUs x $2/h x 10% hits x 88% saved,
    # and 1,000 nodes x 1 TB x $0.15/TB/h
    hours = 3 * 365 * 24
    assert e.gpu_time_saved_usd == pytest.approx(1000 * 8 * 2.0 * 0.10 * 0.88 * hours, rel=1e-9)
    assert e.storage_usd == pytest.approx(1000 * 1.0 * 0.15 * hours, rel=1e-9)
    assert e.net_usd == pytest.approx(1000 * hours * (8 * 2.0 * 0.10 * 0.88 - 0.15), rel=1e-9)


def test_own_account_10k_context():
    r = ledger.context_economics("llama-3.1-70b", "H100", 8, 10_000, 2.0, 0.15, 2)
    assert r.kv_bytes / 1e9 == pytest.approx(3.3, abs=0.05)
    assert r.storage_usd_per_h == pytest.approx(0.0005, rel=0.05)
    assert r.hit_saves_usd == pytest.approx(0.0026, rel=0.05)
    assert r.breakeven_hits_per_h == pytest.approx(0.19, rel=0.05)


def test_longer_contexts_pay_off_sooner():
    hits = [ledger.context_economics("llama-3.1-70b", "H100", 8, n, 2.0, 0.15, 2).breakeven_hits_per_h
            for n in (1 * K, 4 * K, 16 * K, 64 * K, 128 * K)]
    assert all(a > b for a, b in zip(hits, hits[1:]))


@pytest.mark.parametrize("model,n,by_hand", [
    # model card shapes: layers x (K, V) x KV heads x head dim x 2 bytes x tokens
    ("llama-3.1-8b", 1000, 32 * 2 * 8 * 128 * 2 * 1000),        # 131,072,000 B: 128 KiB per token
    ("llama-2-7b", 4096, 32 * 2 * 32 * 128 * 2 * 4096),         # 2 GiB: multi-head, 4x LLaMA-3's
    ("qwen3-235b-a22b", 32 * K, 94 * 2 * 4 * 128 * 2 * 32 * K),  # 6.3 GB
    ("deepseek-r1", 100_000, 61 * (512 + 64) * 2 * 100_000),    # MLA: one latent + RoPE key per layer
])
def test_kv_bytes_by_hand_for_model_cards(model, n, by_hand):
    assert ledger.kv_bytes(model, n, 2) == by_hand
    assert ledger.kv_bytes(model, n, 1) == by_hand // 2


def test_layout():
    assert ledger.kv_layout("deepseek-r1").mla_latent == 576 and ledger.kv_layout("deepseek-r1").kv_heads is None
    assert ledger.kv_layout("llama-2-7b").kv_heads == tm.MODELS["llama-2-7b"].n_heads
