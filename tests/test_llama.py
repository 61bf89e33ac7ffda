"""The LLaMA's one forward pass, driven four ways: full prefill, prefill continued from a cache,
one-token decode and the block-diagonal "each chunk alone" prefill (float32, max |diff| <= 1e-5), and
against logits recorded from Hugging Face transformers' LlamaForCausalLM (tests/data/make_reference.py)."""
from pathlib import Path

import torch

from common.llama import KVCache, Llama, LlamaConfig, causal_mask, rope, shift_kv

TOL = 1e-5


def make_model(seed=0, **kw):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=40, **kw)
    m = Llama(cfg).eval()
    # larger weights than the 0.02 init, so attention patterns are far from uniform
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.mul_(8.0)
    return m


def test_kv_bytes_per_token_matches_handout():
    # 4 layers x (K, V) x 2 KV heads x 16 dims x 2 bytes = 512 B/token in FP16
    assert LlamaConfig(vocab_size=10).kv_bytes_per_token(2) == 512


@torch.no_grad()
def test_cached_decode_equals_full_forward():
    m = make_model()
    t = torch.randint(0, 40, (3, 24))
    full, _ = m(t)
    logits, cache = m(t[:, :8])
    outs = [logits]
    for i in range(8, 24):
        logits, cache = m(t[:, i:i + 1], cache=cache)
        outs.append(logits)
    assert len(cache) == 24
    assert (torch.cat(outs, 1) - full).abs().max() <= TOL


@torch.no_grad()
def test_prefill_in_two_halves_equals_one_prefill():
    m = make_model(1)
    t = torch.randint(0, 40, (2, 30))
    full, full_cache = m(t)
    a, cache = m(t[:, :13])
    b, cache = m(t[:, 13:], cache=cache)
    assert (torch.cat([a, b], 1) - full).abs().max() <= TOL
    for i in range(m.cfg.n_layers):
        assert (cache.k[i] - full_cache.k[i]).abs().max() <= TOL
        assert (cache.v[i] - full_cache.v[i]).abs().max() <= TOL


@torch.no_grad()
def test_full_reuse_by_hand_equals_block_diagonal_mask():
    """3 chunks of 8 tokens, each run alone at positions 0..7, K moved to its real position by
    shift_kv, caches concatenated == one forward with a block-diagonal mask."""
    m = make_model(2)
    n, L = 3, 8
    t = torch.randint(0, 40, (2, n * L))
    pos = torch.arange(n * L)
    chunk = pos // L
    block_logits, block_cache = m(t, mask=causal_mask(pos, pos, chunk, chunk))

    caches, logits = [], []
    for c in range(n):
        lg, cc = m(t[:, c * L:(c + 1) * L])  # alone, positions 0..7
        cc.k = [shift_kv(k, c * L, m.cfg.rope_theta) for k in cc.k]
        cc.pos = cc.pos + c * L
        caches.append(cc)
        logits.append(lg)
    reuse = KVCache.cat(caches)
    assert (torch.cat(logits, 1) - block_logits).abs().max() <= TOL
    for i in range(m.cfg.n_layers):
        assert (reuse.k[i] - block_cache.k[i]).abs().max() <= TOL
        assert torch.equal(reuse.v[i], torch.cat([c.v[i] for c in caches], 2))
        assert (reuse.v[i] - block_cache.v[i]).abs().max() <= TOL
    # and a question appended after the reused chunks sees the same thing either way
    q = torch.randint(0, 40, (2, 5))
    a, _ = m(q, cache=reuse)
    b, _ = m(q, cache=block_cache)
    assert (a - b).abs().max() <= TOL


@torch.no_grad()
def test_rope_shift_equals_recompute_at_new_position():
    """Exercise 5: K computed at position 0 and rotated by p == K computed at position p; V unchanged."""
    m = make_model(3)
    t = torch.randint(0, 40, (1, 6))
    x = m.embed(t)
    blk = m.layers[0]
    for p in (1, 7, 1000):
        _, k0, v0 = blk.qkv(x, torch.arange(6))
        _, kp, vp = blk.qkv(x, torch.arange(6) + p)
        assert (shift_kv(k0, p, m.cfg.rope_theta) - kp).abs().max() <= TOL
        assert torch.equal(v0, vp)
    # a rotation preserves norms, and rotating by 0 is the identity
    k = torch.randn(2, 3, 5, 16)
    assert torch.allclose(rope(k, torch.full((5,), 123.0), 1e4).norm(dim=-1), k.norm(dim=-1), atol=1e-5)
    assert torch.equal(rope(k, torch.zeros(5), 1e4), k)


@torch.no_grad()
def test_rope_tables_kept_per_positions_equal_the_formula():
    """rope keeps the cos/sin tables of recent positions: each call still rotates by its own positions."""
    x = torch.randn(2, 3, 5, 8)
    for pos in (torch.arange(5), torch.arange(5) + 7, torch.arange(5), torch.tensor([0.5, 1, 2, 3, 9])):
        ang = pos.double()[:, None] * 10000.0 ** (-torch.arange(0, 8, 2, dtype=torch.float64) / 8)
        cos, sin = (torch.cat([f(ang), f(ang)], -1).float() for f in (torch.cos, torch.sin))
        want = x * cos + torch.cat([-x[..., 4:], x[..., :4]], -1) * sin
        assert torch.equal(rope(x, pos, 10000.0), want)


def test_block_diagonal_mask_changes_later_chunks_only():
    """The mask really cuts cross-chunk attention: the first chunk is identical, later ones differ."""
    m = make_model(4)
    t = torch.randint(0, 40, (1, 16))
    pos = torch.arange(16)
    causal, _ = m(t)
    block, _ = m(t, mask=causal_mask(pos, pos, pos // 8, pos // 8))
    assert (causal[:, :8] - block[:, :8]).abs().max() <= TOL
    assert (causal[:, 8:] - block[:, 8:]).abs().max() > 1e-3


REFERENCE = Path(__file__).resolve().parent / "data" / "hf_llama_tiny.pt"
HF_NAMES = {"self_attn.q_proj": "wq", "self_attn.k_proj": "wk", "self_attn.v_proj": "wv", "self_attn.o_proj": "wo",
            "mlp.gate_proj": "w_gate", "mlp.up_proj": "w_up", "mlp.down_proj": "w_down",
            "input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm"}


def hf_reference():
    """A tiny random LLaMA (GQA 4 query / 2 KV heads, half-split RoPE, tied embeddings) and the logits
    Hugging Face transformers' LlamaForCausalLM computed for it (tests/data/make_reference.py)."""
    ref = torch.load(REFERENCE, weights_only=True)
    c = ref["config"]
    assert c["tie_word_embeddings"] and c["num_key_value_heads"] < c["num_attention_heads"]
    cfg = LlamaConfig(vocab_size=c["vocab_size"], d_model=c["hidden_size"], n_layers=c["num_hidden_layers"],
                      n_heads=c["num_attention_heads"], n_kv_heads=c["num_key_value_heads"], head_dim=c["head_dim"],
                      d_ff=c["intermediate_size"], rope_theta=c["rope_theta"], norm_eps=c["rms_norm_eps"])
    ours = {}
    for name, w in ref["state_dict"].items():
        name = name.removeprefix("model.").replace("embed_tokens", "embed")
        for hf, mine in HF_NAMES.items():
            name = name.replace(hf, mine)
        ours[name] = w
    m = Llama(cfg).eval()
    m.load_state_dict(ours, strict=True)
    return m, ref


@torch.no_grad()
def test_logits_equal_hugging_face_llama():
    """Same weights, same tokens: our forward reproduces transformers' logits (float32, logits O(5)), in
    one prefill, in a prefill continued from a cache, and with the attention weights written out."""
    m, ref = hf_reference()
    t, expected = ref["tokens"], ref["logits"]
    assert float(expected.abs().max()) > 1.0
    logits, _ = m(t)
    assert (logits - expected).abs().max() <= 1e-4
    a, cache = m(t[:, :17])
    b, _ = m(t[:, 17:], cache=cache)
    assert (torch.cat([a, b], 1) - expected).abs().max() <= 1e-4
    for blk in m.layers:
        blk.keep_weights = True
    assert (m(t)[0] - expected).abs().max() <= 1e-4


@torch.no_grad()
def test_gqa_is_multi_head_with_shared_kv_heads():
    """Query head h reads KV head h // (n_heads / n_kv_heads): a GQA model (4 query, 2 KV heads) equals
    the multi-head model whose K and V projections repeat each KV head for its two query heads; the
    cache holds only the 2 KV heads."""
    g = make_model(5, n_heads=4, n_kv_heads=2)
    m = make_model(6, n_heads=4, n_kv_heads=4)
    sd = g.state_dict()
    for name, w in sd.items():
        if name.endswith(("wk.weight", "wv.weight")):
            sd[name] = w.view(2, 16, -1).repeat_interleave(2, 0).reshape(64, -1)  # heads 0,0,1,1
    m.load_state_dict(sd)
    t = torch.randint(0, 40, (2, 7))
    (lg, cache), (lm, _) = g(t), m(t)
    assert cache.k[0].shape == (2, 2, 7, 16) and cache.pos.tolist() == list(range(7))
    assert (lg - lm).abs().max() <= TOL
    for name, w in g.state_dict().items():   # the other pairing (heads 0,1,0,1) is a different model
        if name.endswith(("wk.weight", "wv.weight")):
            sd[name] = w.view(2, 16, -1).repeat(2, 1, 1).reshape(64, -1)
    m.load_state_dict(sd)
    assert (m(t)[0] - lg).abs().max() > 1e-2


@torch.no_grad()
def test_explicit_attention_weights_equal_sdpa():
    """Block.keep_weights writes the softmax out (for blend_world's locality penalty): same outputs as
    scaled_dot_product_attention, and the kept weights are a causal distribution per query."""
    m = make_model(3)
    t = torch.randint(0, 40, (2, 17))
    ref, ref_cache = m(t)
    for blk in m.layers:
        blk.keep_weights = True
    out, cache = m(t)
    assert (out - ref).abs().max() <= TOL
    for blk in m.layers:
        w = blk.weights
        assert w.shape == (2, m.cfg.n_heads, 17, 17)
        assert torch.allclose(w.sum(-1), torch.ones(()), atol=1e-6)
        assert w.triu(1).abs().max() == 0          # no weight on the future
        blk.keep_weights, blk.weights = False, None


def test_idle_threads_gives_one_thread_per_idle_core(monkeypatch):
    """idle_threads: one torch thread per idle core (rounded down, with a quarter core of slack), never more
    than the count before it, at least one, and one where idle cores cannot be read; restored after."""
    import common.llama as llama

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for idle, want in [(1.9, 2), (1.75, 2), (1.5, 1), (1.2, 1), (0.1, 1), (None, 1), (5.0, 2)]:
            monkeypatch.setattr(llama, "idle_cores", lambda window=0.2, v=idle: v)
            with llama.idle_threads():
                assert torch.get_num_threads() == want
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_idle_cores_reads_a_share_of_the_machine():
    import os

    from common.llama import cpu_times, idle_cores

    # /proc/stat: cpu user nice system idle iowait irq softirq steal guest guest_nice
    assert cpu_times("cpu  100 5 45 800 50 0 0 0 0 0") == (850, 1000)
    idle = idle_cores(0.05)
    assert idle is None or 0.0 <= idle <= (os.cpu_count() or 1) + 1e-9
