"""gpu_check.py, the GPU against the time model, on this CPU: `--tiny` runs the whole check on the city LLaMA's
shapes (its tables, its --json keys, the H200's reference column blank for rows the H200 never ran); the layer
it times is a LLaMA layer (CacheBlend's selective recompute gives a full prefill's rows: the selected rows with
the full prefill's own cache, every row at ratio 1 from a stale one; the mask lets a token read the keys at or
before its position and no later one; a decode step gives the next row of a longer prefill); the weights have
the published shapes; without a CUDA device it says so in one line and exits 2. The CUDA path (events, pinned
memory, the second stream) runs only on a GPU."""
import importlib
import json

import pytest
import torch

from common import gpu_reference as gr
from common import timemodel as tm
from common.llama import LlamaConfig
from common.present import DASH
from lecture27.gpu import measure as gm

mod = importlib.import_module("lecture27.gpu_check")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu") / "tiny.json"
    page = mod.main(["--tiny", "--no-plot", "--runs", "2", "--warmup", "1", "--json", str(out)])
    return page, json.loads(out.read_text())


def expected_keys() -> set:
    """Every row --tiny measures, by the key the reference and --json share."""
    m, (a, b) = mod.TINY_MODEL, mod.TINY_TOKENS
    keys = {gr.row_key("matmul", tokens=mod.TINY_MATMUL)}
    keys |= {gr.row_key("prefill", m, n) for n in (a, b)}
    keys |= {gr.row_key(k, m, n, **({"memory": "pinned"} if k == "layer_kv" else {}))
             for n in (a, b) for k in ("layer", "recompute", "layer_kv")}
    keys |= {gr.row_key("kv", m, b, memory=x, per_layer=p) for x in ("pinned", "pageable") for p in (False, True)}
    keys |= {gr.row_key("decode", m, b, batch=x) for x in mod.TINY_BATCHES}
    keys |= {gr.row_key("pipeline", m, n, schedule=x) for n in (a, b) for x in ("serial", "pipelined")}
    return keys


def test_tiny_measures_every_row_and_writes_its_json_keys(tiny):
    page, data = tiny
    assert set(data["rows"]) == expected_keys()
    for key, row in data["rows"].items():
        assert row["measured_s"] > 0, key
        if "pageable" in key:                       # the time model has one host-link rate: a pinned copy's
            assert row["timemodel_s"] is None and row["measured_over_model"] is None
        else:
            assert row["timemodel_s"] > 0 and row["measured_over_model"] == pytest.approx(
                row["measured_s"] / row["timemodel_s"])
    assert {"device", "gpu", "gpu_name", "torch", "dtype", "timer", "tiny", "runs", "warmup", "ratio", "matmul_tflops",
            "h2d_pinned_GBps", "h2d_pageable_GBps", "recompute_share", "fetch_vs_prefill", "mfu_measured"} <= set(data)
    assert data["tiny"] and data["gpu"] == "H200" and data["timer"] == "perf_counter" and data["dtype"] == "bfloat16"
    assert set(data["recompute_share"]) == {f"city@{n}" for n in mod.TINY_TOKENS}
    assert [b["name"] for b in page.blocks if b["kind"] == "part"] == [f"Part {i}" for i in range(1, 6)]


def test_the_reference_column_is_the_h200s_and_blank_for_rows_it_never_ran(tiny):
    page, _ = tiny
    for t in page.tables:
        ref = [c for c in t.cols if c.reference]
        assert [c.header for c in ref] == [gr.H200.label] == ["H200 measured (2026-12-04)"]
        assert all(r.cells[-1] == DASH for r in t.rows)          # the city LLaMA is no row of the H200's


def test_the_reference_holds_for_its_rows_at_their_ratio():
    """The H200's recompute at 4K shows beside a run at 15%, not beside one at 30%; a row it never ran: nothing."""
    from common.present import handout
    key = gr.row_key("recompute", "llama-2-7b", 4096)
    assert handout(mod.gp.MEASURED, key, {"ratio": 0.15}).figure == "0.867 ms (32% of the layer)"
    assert handout(mod.gp.MEASURED, key, {"ratio": 0.30}) == DASH
    assert handout(mod.gp.MEASURED, gr.row_key("prefill", "city", 64), {"ratio": 0.15}) == DASH


def test_the_reference_data_keeps_every_measured_row_with_its_source():
    ref = gr.load()
    assert len(ref.rows) == 37 and ref.gpu == "H200" and ref.date == "2026-12-04" and "H200" in ref.source
    assert ref.rows[gr.row_key("prefill", "llama-3.1-8b", 12288)].seconds == pytest.approx(0.348, abs=5e-4)
    assert ref.rows[gr.row_key("kv", "llama-3.1-8b", 12288, memory="pageable")].seconds == pytest.approx(0.0924,
                                                                                                          abs=5e-4)
    pinned = ref.rows[gr.row_key("kv", "llama-3.1-8b", 12288, memory="pinned")]
    assert gr.figure_text(ref, pinned) == "29.1 ms (55 GB/s)"


@pytest.mark.parametrize("model, width", [("llama-3.1-8b", 14336), ("llama-3.1-70b", 28672), ("llama-2-7b", 11008),
                                          ("city", 192)])
def test_the_layers_have_the_published_shapes(model, width):
    """The SwiGLU width the time model's parameter count implies is the model's config.json d_ff, and a random
    layer holds exactly the parameters the time model counts per layer (norms aside)."""
    assert gm.ffn_width(model) == width
    m = tm.get_model(model)
    d, H, Hkv, hd = m.d_model, m.n_heads, m.n_kv_heads, m.head_dim
    shapes = [(d, (H + 2 * Hkv) * hd), (H * hd, d), (d, 2 * width), (width, d)]
    assert sum(a * b for a, b in shapes) == m.linear_params / m.n_layers
    if model == "city":
        layer = gm.random_layers(gm.Device(False, torch.float32), model, 1)[0]
        assert [tuple(w.shape) for w in (layer.w_qkv, layer.wo, layer.w_gate_up, layer.w_down)] == shapes
    with pytest.raises(ValueError):
        gm.ffn_width("deepseek-r1")


def models():
    """A GQA LLaMA (the city LLaMA's shapes: 4 query heads, 2 KV heads) and a multi-head one."""
    return ["city", tm.dense_model("mha", LlamaConfig(vocab_size=16, n_heads=4, n_kv_heads=4))]


def full_prefill(model, T):
    dev = gm.Device(False, torch.float32, seed=1)
    m = tm.get_model(model)
    layer = gm.random_layers(dev, model, 1)[0]
    cos, sin = gm.rope_tables(dev, T + 1, m.head_dim)
    x = dev.randn(1, T + 1, m.d_model)
    return dev, m, layer, cos, sin, x


@pytest.mark.parametrize("model", models(), ids=["gqa", "mha"])
def test_the_recomputed_rows_are_the_full_prefills_rows(model):
    """With the full prefill's own K, V as the cache, recomputing the selected tokens gives the full prefill's
    rows at their positions: each selected token read exactly the keys at or before it."""
    dev, m, layer, cos, sin, x = full_prefill(model, 48)
    out, k, v = gm.prefill_layer(layer, x[:, :48], cos, sin)
    pos = gm.selected_positions(dev, 48, 0.25)
    assert len(pos) == 12 and pos.tolist() == sorted(set(pos.tolist()))
    mask = gm.recompute_mask(pos, 48, m.n_heads // m.n_kv_heads, dev.dtype, dev.device)
    got = gm.recompute_layer(layer, x[:, pos], pos, k.clone(), v.clone(), mask, cos, sin)
    torch.testing.assert_close(got, out[:, pos], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("model", models(), ids=["gqa", "mha"])
def test_at_ratio_one_the_recompute_is_a_full_prefill_from_any_cache(model):
    dev, m, layer, cos, sin, x = full_prefill(model, 40)
    out, k, v = gm.prefill_layer(layer, x[:, :40], cos, sin)
    pos = gm.selected_positions(dev, 40, 1.0)
    assert pos.tolist() == list(range(40))
    mask = gm.recompute_mask(pos, 40, m.n_heads // m.n_kv_heads, dev.dtype, dev.device)
    stale_k, stale_v = torch.randn_like(k), torch.randn_like(v)
    got = gm.recompute_layer(layer, x[:, :40], pos, stale_k, stale_v, mask, cos, sin)
    torch.testing.assert_close(got, out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(stale_k, k)                    # the cache is now the full prefill's
    torch.testing.assert_close(stale_v, v)


def test_the_mask_is_causal_by_position_for_every_folded_head():
    pos = torch.tensor([3, 7, 20])
    mask = gm.recompute_mask(pos, 24, 2, torch.float32, "cpu")
    assert mask.shape == (6, 24)
    for row, p in zip(mask, pos.tolist() * 2):
        assert (row[:p + 1] == 0).all() and torch.isinf(row[p + 1:]).all() and (row[p + 1:] < 0).all()


@pytest.mark.parametrize("model", models(), ids=["gqa", "mha"])
def test_a_decode_step_gives_the_next_row_of_a_longer_prefill(model):
    dev, m, layer, cos, sin, x = full_prefill(model, 32)
    longer, _, _ = gm.prefill_layer(layer, x, cos, sin)
    _, k, v = gm.prefill_layer(layer, x[:, :32], cos, sin)
    k_cache, v_cache = torch.zeros(1, m.n_kv_heads, 33, m.head_dim), torch.zeros(1, m.n_kv_heads, 33, m.head_dim)
    k_cache[:, :, :32], v_cache[:, :, :32] = k, v
    got = gm.decode_layer(layer, x[:, 32:], 32, k_cache, v_cache, cos, sin)
    torch.testing.assert_close(got, longer[:, 32:], atol=1e-5, rtol=1e-5)


def test_the_pipeline_on_the_time_model_is_two_streams():
    serial, piped = gm.pipeline_model_s("llama-2-7b", "H200", 4096, 0.15)
    assert serial * 1e3 == pytest.approx(48.25, abs=0.05) and piped * 1e3 == pytest.approx(34.01, abs=0.05)


@pytest.mark.parametrize("name, row", [("NVIDIA H200", "H200"), ("NVIDIA H100 80GB HBM3", "H100"),
                                       ("NVIDIA A100-SXM4-80GB", "A100-80GB"), ("NVIDIA A100-SXM4-40GB", None),
                                       ("NVIDIA A40", "A40"), ("AMD Instinct MI300X", "MI300X"),
                                       ("NVIDIA GeForce RTX 4090", None)])
def test_the_device_is_matched_to_its_row_of_the_time_model(name, row):
    assert gm.gpu_row(name) == row


def test_without_a_gpu_it_says_so_in_one_line_and_exits_2(cli_exit, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, err = cli_exit("gpu_check")
    assert code == 2 and err.count("\n") == 1 and "no CUDA device" in err and "--tiny" in err
    code, err = cli_exit("gpu_check", "--tiny", "--ratio", "0")
    assert code == 2 and err.count("\n") == 1 and "--ratio" in err
    code, err = cli_exit("gpu_check", "--gpu", "B200")
    assert code == 2 and err.count("\n") == 1 and "--gpu" in err
