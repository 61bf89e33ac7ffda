"""The time model: KV layouts by hand, the two anchors, and the identities the other scripts rely on
(chunked prefill adds up, recompute of everything = prefill, per-layer x layers = total)."""
import pytest

from common import timemodel as tm


def test_kv_bytes_per_token_by_hand():
    # K and V x layers x KV heads x head dim x 2 bytes (handout §10 exercise 1)
    assert tm.kv_bytes_per_token("llama-3.1-70b") == 2 * 80 * 8 * 128 * 2 == 327_680
    assert tm.kv_bytes_per_token("llama-3.1-8b") == 2 * 32 * 8 * 128 * 2 == 128 * 1024
    assert tm.kv_bytes_per_token("llama-2-7b") == 2 * 32 * 32 * 128 * 2 == 512 * 1024  # multi-head
    # MLA: 61 layers x (512 latent + 64 RoPE key) x 2 bytes = 68.6 KiB (slides p.8)
    assert tm.kv_bytes_per_token("deepseek-r1") == 61 * (512 + 64) * 2 == 70_272
    assert tm.kv_bytes_per_token("qwen3-235b-a22b") == 2 * 94 * 4 * 128 * 2
    assert tm.kv_bytes_per_token("llama-3.1-70b", bytes_per_value=1) == 163_840


def test_small_models_match_the_llama_config():
    from common.llama import LlamaConfig
    cfg = LlamaConfig(vocab_size=64)
    for key in ("city", "record"):
        assert tm.kv_bytes_per_token(key) == cfg.kv_bytes_per_token() == 512  # handout §3.4: 512 B in FP16


@pytest.mark.parametrize("key,card", [("llama-3.1-8b", 8.03e9), ("llama-3.1-70b", 70.6e9), ("llama-2-7b", 6.74e9)])
def test_dense_parameter_counts_match_model_cards(key, card):
    assert tm.MODELS[key].total_params == pytest.approx(card, rel=0.01)


def test_third_point_one_gpu_by_hand():
    """A point the fit did not see, by hand from the handout's anchor (LLaMA-3.1-8B, 12K tokens, one
    H100, 0.36 s): one GPU has no communication, so time is proportional to FLOPs. Per layer:
      linear      2 x (4096*4096 + 2*4096*1024 + 4096*4096 + 3*4096*14336) = 2 x 218,103,808 per token
      attention   2 x 32 heads x (128 + 128) = 16,384 per (query, key) pair, n(n+1)/2 pairs (causal)
    so t(4K) = 0.36 s x F(4096) / F(12288) = 0.1050 s; and 4K after 8K cached costs F(8K..12K)."""
    F = lambda n: 2 * 218_103_808 * n + 16_384 * n * (n + 1) / 2
    assert F(4096) / F(12_288) == pytest.approx(0.29166, abs=1e-5)
    assert tm.prefill_time("llama-3.1-8b", "H100", 4096) == pytest.approx(0.36 * F(4096) / F(12_288), rel=1e-9)
    tail = 2 * 218_103_808 * 4096 + 16_384 * (4096 * 8192 + 4096 * 4097 / 2)
    assert tm.prefill_time("llama-3.1-8b", "H100", 4096, 8192) == pytest.approx(0.36 * tail / F(12_288), rel=1e-9)
    # an H200 has the H100's compute: same prefill time; an A100 has 312 of its 989.4 TFLOP/s
    assert tm.prefill_time("llama-3.1-8b", "A100-80GB", 4096) == pytest.approx(
        0.36 * F(4096) / F(12_288) * 989.4 / 312, rel=1e-9)


def test_tensor_parallel_communication_by_hand():
    """On 8 GPUs each layer adds two ring all-reduces of the n x 8192 BF16 activations, each moving
    2 x 7/8 of the message over a 450 GB/s link at the fitted efficiency; the compute is split 8 ways."""
    n = 16 * 1024
    comm = 80 * 2 * (2 * 7 / 8) * (n * 8192 * 2) / (450e9 * tm.TP_COMM_EFFICIENCY)
    t1 = tm.prefill_time("llama-3.1-70b", "H100", n, 0, 1)
    assert tm.prefill_time("llama-3.1-70b", "H100", n, 0, 8) == pytest.approx(t1 / 8 + comm, rel=1e-9)
    assert tm.prefill_time("llama-3.1-70b", "H100", n, 0, 8) == pytest.approx(0.97, rel=1e-6)  # the anchor


def test_fitted_constants_are_physical():
    assert 0.3 < tm.MFU < 0.8            # prefill of a dense model on an H100
    assert 0.1 < tm.TP_COMM_EFFICIENCY <= 1.0


def test_unfitted_prediction_cacheblend_paper_point():
    # Not fitted: CacheBlend's LLaMA-7B on an A40, 4K context, 15% recompute ~3 ms per layer (handout §5.4)
    per_layer = tm.recompute_time("llama-2-7b", "A40", 4096, 0.15) / 32
    assert 2e-3 < per_layer < 4e-3


@pytest.mark.parametrize("n_gpus", [1, 8])
def test_chunked_prefill_adds_up(n_gpus):
    full = tm.prefill_time("llama-3.1-70b", "H100", 12_000, 0, n_gpus)
    chunks = sum(tm.prefill_time("llama-3.1-70b", "H100", 1500, c, n_gpus) for c in range(0, 12_000, 1500))
    assert chunks == pytest.approx(full, rel=1e-9)


def test_a_chunk_after_a_cache_costs_more_than_the_same_chunk_alone():
    alone = tm.prefill_time("llama-3.1-8b", "H100", 1500, 0)
    after = tm.prefill_time("llama-3.1-8b", "H100", 1500, 30_000)
    assert after > 1.1 * alone  # its queries attend to the 30K cached keys as well


def test_layer_time_times_layers_is_prefill_time():
    m = tm.MODELS["llama-3.1-70b"]
    assert m.n_layers * tm.prefill_layer_time(m, "H100", 4096, 1024, 8) == pytest.approx(
        tm.prefill_time(m, "H100", 4096, 1024, 8))


def test_recompute_all_is_prefill_and_fraction_is_cheaper():
    full = tm.prefill_time("llama-2-7b", "A40", 4096)
    assert tm.recompute_time("llama-2-7b", "A40", 4096, 1.0) == pytest.approx(full)
    r15 = tm.recompute_time("llama-2-7b", "A40", 4096, 0.15)
    assert 0.14 * full < r15 < 0.16 * full
    assert tm.recompute_time("llama-2-7b", "A40", 4096, 0.0) == 0.0


def test_prefill_is_superlinear_in_length():
    t = lambda n: tm.prefill_time("llama-3.1-70b", "H100", n, 0, 8)
    assert t(65_536) > 4 * t(16_384) > 16 * t(4096)


def test_decode_is_memory_bound_by_hand():
    m, g = tm.MODELS["llama-3.1-70b"], tm.GPUS["H100"]
    by_hand = (2 * m.total_params / 8 + 327_680 * 16_384 * 4 / 8) / g.hbm_bw  # 8 KV heads over 8 GPUs
    assert tm.decode_time_per_token(m, g, 16_384, batch=4, n_gpus=8) == pytest.approx(by_hand)
    assert 4e-3 < tm.decode_time_per_token(m, g, 0, 1, 8) < 6e-3  # ~141 GB / 8 / 3.35 TB/s
    # MLA's single latent is replicated, not split, across GPUs
    d = tm.MODELS["deepseek-r1"]
    kv_part = tm.decode_time_per_token(d, "H200", 10_000, 1, 8) - tm.decode_time_per_token(d, "H200", 0, 1, 8)
    assert kv_part == pytest.approx(70_272 * 10_000 / tm.GPUS["H200"].hbm_bw)


def test_attention_flops_per_query_key_pair_by_hand():
    """Q.K^T over the query-key width and P.V over the value width, 2 FLOPs per multiply-add, every head:
    MLA's Q.K is 192 wide (128 + 64 RoPE) and its V 128."""
    assert tm.MODELS["llama-3.1-8b"].attn_pair_flops == 2 * 32 * (128 + 128)
    assert tm.MODELS["deepseek-r1"].attn_pair_flops == 2 * 128 * (192 + 128)


def test_names_or_objects():
    assert tm.prefill_time("llama-3.1-8b", "H100", 1000) == tm.prefill_time(
        tm.MODELS["llama-3.1-8b"], tm.GPUS["H100"], 1000)


def test_tables_have_the_briefs_keys():
    assert set(tm.GPUS) == {"H100", "H200", "A100-80GB", "A40", "MI300X"}
    assert set(tm.MODELS) == {"llama-3.1-8b", "llama-3.1-70b", "llama-2-7b", "llama-3-8b",
                              "qwen3-235b-a22b", "deepseek-r1", "city", "record"}
