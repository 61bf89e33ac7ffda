"""A slow, obviously-correct CacheBlend to hold blend_world.blend against, at ratios strictly between 0
and 1, with and without a shared prefix.

The reference is written row by row from the definitions, in float64, using only the model's weights:
  * its own RMSNorm, RoPE (half-split pairs, angle p * theta^(-2i/hd)), grouped-query attention (query
    head h reads KV head h // (H / Hkv)) with an explicit list of the keys each row may see, SwiGLU;
  * the precomputed chunks: each chunk computed seeing only itself and the shared prefix, at the
    positions it had when stored (0, 1, ... without a prefix; P, P+1, ... behind a P-token prefix),
    its K then rotated to the real position (what "prefill alone, then shift_kv" must equal);
  * the blend for a FIXED selection S_1 >= S_2 >= ... (the sets the blend reports in its trace):
    layer 0 is computed in full; at layer l >= 1 the tokens of S_l and the question get fresh K, V from
    their own hidden states, every other context token keeps its precomputed K, V, and each computed row
    attends, causally by position, to that mixed cache.
It also recomputes the scores the selection is made from (the layer-0 attention deviation: full causal
attention minus attention to the own chunk and the prefix, both at real positions, as blend defines it;
and the per-layer ||dK||^2 + ||dV||^2) and checks that each set is the top-count of those scores."""
import math

import pytest
import torch

from lecture27 import blend_rules as rules
from lecture27 import blend_world as bw
from common.llama import shift_kv
from lecture27 import record_trainer as rt
from common.trainer import init_weights

P = bw.PREFIX
TOL = 1e-5


def rms(x, w, eps):
    return x / math.sqrt(float((x * x).mean()) + eps) * w


def rope_row(x, p, theta):
    """x (..., hd) rotated to position p: pair (i, i + hd/2) by angle p * theta^(-2i/hd)."""
    hd = x.shape[-1]
    a = p * theta ** (-2 * torch.arange(hd // 2, dtype=torch.float64) / hd)
    c, s = a.cos().to(x.dtype), a.sin().to(x.dtype)
    lo, hi = x[..., :hd // 2], x[..., hd // 2:]
    return torch.cat([lo * c - hi * s, hi * c + lo * s], -1)


def kv_row(blk, h, p):
    """Fresh K, V (Hkv, hd) of one token with hidden state h at position p."""
    c = blk.cfg
    n = rms(h, blk.attn_norm.weight, c.norm_eps)
    k = (blk.wk.weight @ n).view(c.n_kv_heads, c.head_dim)
    v = (blk.wv.weight @ n).view(c.n_kv_heads, c.head_dim)
    return rope_row(k, p, c.rope_theta), v


def attn_row(blk, h, p, K, V, seen):
    """Per-head attention output (H * hd,) of one row: h at position p attending to keys K[:, j] for j
    in `seen` (K, V: (Hkv, S, hd) already rotated)."""
    c = blk.cfg
    n = rms(h, blk.attn_norm.weight, c.norm_eps)
    q = (blk.wq.weight @ n).view(c.n_heads, c.head_dim)
    group = c.n_heads // c.n_kv_heads
    outs = []
    for hh in range(c.n_heads):
        qh = rope_row(q[hh], p, c.rope_theta)
        kv = hh // group
        s = K[kv, seen] @ qh / math.sqrt(c.head_dim)
        w = torch.exp(s - s.max())
        outs.append((w / w.sum()) @ V[kv, seen])
    return torch.cat(outs)


def finish_row(blk, h, a):
    c = blk.cfg
    x = h + blk.wo.weight @ a
    m = rms(x, blk.mlp_norm.weight, c.norm_eps)
    g = blk.w_gate.weight @ m
    return x + blk.w_down.weight @ (g * torch.sigmoid(g) * (blk.w_up.weight @ m))


def ref_precompute(model, doc, ids):
    """(L, Hkv, N, hd) K and V of full KV reuse: each chunk computed alone behind the prefix, at the
    positions it had then (prefix 0..P-1, the chunk P, P+1, ...), its K then rotated to the real
    position (RoPE composes); the prefix is computed once, causally."""
    N = len(doc)
    n_pre = ids.count(P)
    start = {c: ids.index(c) for c in set(ids) if c != P}
    vp = [i if ids[i] == P else n_pre + i - start[ids[i]] for i in range(N)]
    own = [[j for j in range(i + 1) if ids[j] == ids[i] or ids[j] == P] for i in range(N)]
    h = [model.embed.weight[t] for t in doc]
    Ks, Vs = [], []
    for blk in model.layers:
        kv = [kv_row(blk, h[i], vp[i]) for i in range(N)]
        K, V = torch.stack([k for k, _ in kv], 1), torch.stack([v for _, v in kv], 1)
        h = [finish_row(blk, h[i], attn_row(blk, h[i], vp[i], K, V, own[i])) for i in range(N)]
        Ks.append(torch.stack([rope_row(K[:, i], i - vp[i], blk.cfg.rope_theta) for i in range(N)], 1))
        Vs.append(V)
    return Ks, Vs


def ref_blend(model, doc, question, ids, sels):
    """Question logits (Tq, vocab) and the scores behind each selection, for fixed sets sels[l-1] = S_l."""
    N, Tq = len(doc), len(question)
    pre_k, pre_v = ref_precompute(model, doc, ids)
    pos = list(range(N + Tq))
    h = {i: model.embed.weight[t] for i, t in enumerate(list(doc) + list(question))}
    # layer 0: K, V of every token are fresh (they equal the precomputed ones); deviation of attention
    blk = model.layers[0]
    kv = [kv_row(blk, h[i], i) for i in pos]
    K, V = torch.stack([k for k, _ in kv], 1), torch.stack([v for _, v in kv], 1)
    dev0 = []
    for i in range(N):
        full = attn_row(blk, h[i], i, K, V, list(range(i + 1)))
        own = attn_row(blk, h[i], i, K, V, [j for j in range(i + 1) if ids[j] == ids[i] or ids[j] == P])
        dev0.append(float(((full - own) ** 2).sum()))
    rows = list(sels[0]) + list(range(N, N + Tq))
    h = {i: finish_row(blk, h[i], attn_row(blk, h[i], i, K, V, list(range(i + 1)))) for i in rows}
    devs = []
    for layer, sel in enumerate(sels, start=1):
        blk = model.layers[layer]
        rows = list(sel) + list(range(N, N + Tq))
        K = torch.cat([pre_k[layer], torch.zeros(pre_k[layer].shape[0], Tq, pre_k[layer].shape[2],
                                                 dtype=pre_k[layer].dtype)], 1)
        V = torch.cat([pre_v[layer], torch.zeros_like(K[:, N:])], 1)
        dev = {}
        for i in rows:
            k, v = kv_row(blk, h[i], i)
            if i < N:
                dev[i] = float(((k - K[:, i]) ** 2).sum() + ((v - V[:, i]) ** 2).sum())
            K[:, i], V[:, i] = k, v
        devs.append(dev)
        h = {i: finish_row(blk, h[i], attn_row(blk, h[i], i, K, V, list(range(i + 1)))) for i in rows}
    x = torch.stack([h[i] for i in range(N, N + Tq)])
    x = torch.stack([rms(r, model.norm.weight, model.cfg.norm_eps) for r in x])
    return x @ model.embed.weight.T, torch.tensor(dev0), devs


@pytest.fixture(scope="module")
def model64():
    torch.manual_seed(0)
    m = bw.Llama(bw.model_config()).eval()
    init_weights(m, torch.Generator().manual_seed(0), rt.TRAIN["embed_std"], rt.TRAIN["linear_std"])
    return m.double()


CASES = {  # chunk ids of a 24-token context: chunks of 5 / a 3-token prefix and chunks of uneven length
    "chunks of 5": bw.chunk_ids(bw.DOC_LEN, 5),
    "prefix": torch.tensor([P] * 3 + [0] * 6 + [1] * 4 + [2] * 7 + [3] * 4),
}


@pytest.mark.parametrize("rule", ["progressive", "flat"])
@pytest.mark.parametrize("ratio", [0.2, 0.5])
@pytest.mark.parametrize("case", list(CASES))
@torch.no_grad()
def test_blend_equals_the_row_by_row_reference(model64, ratio, case, rule):
    ids = CASES[case]
    rec = bw.sample_records(2, torch.Generator().manual_seed(3), n_questions=3)
    logits, tr = bw.blend(model64, rec, ids, ratio, rule=rules.RULES[rule], trace=True)
    counts = rules.RULES[rule].counts(bw.DOC_LEN, ratio, model64.cfg.n_layers)
    assert [s.shape[1] for s in tr.recomputed] == counts
    assert 0 < min(counts) and max(counts) < bw.DOC_LEN  # a partial selection, not an endpoint
    assert counts[-1] < counts[0] if rule == "progressive" else len(set(counts)) == 1
    for b in range(2):
        sels = [s[b].tolist() for s in tr.recomputed]
        ref, dev0, devs = ref_blend(model64, rec.doc[b].tolist(), rec.question[b].tolist(), ids.tolist(), sels)
        assert (logits[b] - ref).abs().max() <= TOL
        # the selection is the one the scores call for: top counts of the layer-0 attention deviation,
        # then, layer by layer, the largest KV deviations among the tokens just recomputed
        assert (tr.attn_dev0[b] - dev0).abs().max() <= TOL * max(1.0, float(dev0.max()))
        assert sorted(sels[0]) == sorted(dev0.topk(counts[0]).indices.tolist())
        for layer in range(1, len(sels)):
            d = devs[layer - 1]
            top = sorted(sorted(d, key=d.get, reverse=True)[:counts[layer]])
            assert sels[layer] == top
    # the blend really differs from full reuse and from full prefill here (so the match means something)
    reuse = bw.full_reuse(model64, rec, ids)
    full = bw.full_prefill(model64, rec)
    assert (logits - full).abs().max() > 1e-3
    assert (logits - reuse).abs().max() > 1e-3


@torch.no_grad()
def test_precompute_with_prefix_equals_the_reference(model64):
    """Chunks precomputed behind a shared prefix (each alone at positions P.., K moved by shift_kv) equal
    every token computed at its real position seeing only its own chunk and the prefix."""
    ids = CASES["prefix"]
    doc = bw.sample_records(1, torch.Generator().manual_seed(4)).doc
    pre = bw.precompute_chunks(model64, doc, ids)
    rk, rv = ref_precompute(model64, doc[0].tolist(), ids.tolist())
    for i in range(model64.cfg.n_layers):
        assert (pre.k[i][0] - rk[i]).abs().max() <= TOL
        assert (pre.v[i][0] - rv[i]).abs().max() <= TOL
    assert torch.equal(pre.pos, torch.arange(bw.DOC_LEN))


@torch.no_grad()
def test_full_reuse_with_prefix_by_hand_equals_the_masked_forward(model64):
    """Full reuse with a prefix built by hand (prefix prefilled once; each chunk prefilled behind it
    and moved to its place; caches concatenated) equals ONE forward over the whole context with each
    chunk at the positions it had behind the prefix (3, 4, ...) and the own-chunk-plus-prefix mask,
    its K then moved by (real - stored) positions; a question appended after either sees the same
    thing, and blend at ratio 0 is that. A chunk that sat behind the prefix at positions 3.. lands at
    its real positions (9.. for the second chunk)."""
    ids = CASES["prefix"]
    rec = bw.sample_records(2, torch.Generator().manual_seed(6), n_questions=4)
    doc, theta = rec.doc, model64.cfg.rope_theta
    n_pre = 3
    _, prefix = model64(doc[:, :n_pre])
    parts = [prefix]
    for start, end in bw.chunk_spans(ids):
        _, c = model64(doc[:, start:end], cache=prefix)            # behind the prefix, positions 3..
        assert c.pos[n_pre:].tolist() == list(range(n_pre, n_pre + end - start))
        parts.append(bw.KVCache(k=[shift_kv(k[:, :, n_pre:], start - n_pre, theta) for k in c.k],
                                v=[v[:, :, n_pre:] for v in c.v], pos=c.pos[n_pre:] + start - n_pre))
    by_hand = bw.KVCache.cat(parts)
    pos = torch.arange(bw.DOC_LEN)
    assert by_hand.pos[9:13].tolist() == [9, 10, 11, 12]              # chunk 1 (ids 1) sits at 9..12
    stored = torch.tensor([0, 1, 2] + list(range(3, 9)) + list(range(3, 7)) + list(range(3, 10))
                          + list(range(3, 7)))                        # where each token was computed
    mask = bw.causal_mask(stored, stored, ids, ids) | bw.causal_mask(stored, stored) & (ids == P)[None, :]
    _, masked = model64(doc, pos=stored, mask=mask)
    moved = [shift_kv(k, (pos - stored).double(), theta) for k in masked.k]
    pre = bw.precompute_chunks(model64, doc, ids)
    assert torch.equal(by_hand.pos, pos) and torch.equal(pre.pos, pos)
    for i in range(model64.cfg.n_layers):
        for c in (by_hand, pre):
            assert (c.k[i] - moved[i]).abs().max() <= TOL
            assert (c.v[i] - masked.v[i]).abs().max() <= TOL
    q_pos = torch.arange(bw.DOC_LEN, bw.DOC_LEN + rec.question.shape[1])
    a, _ = model64(rec.question, cache=by_hand)
    b, _ = model64(rec.question, cache=bw.KVCache(moved, masked.v, pos), pos=q_pos)
    assert (a - b).abs().max() <= TOL
    assert (bw.blend(model64, rec, ids, 0.0) - b).abs().max() <= TOL
    # the positions matter: the same mask at the real positions (each chunk seeing the prefix from
    # further away) is a different cache from the second chunk on, and moving by the wrong amount too
    _, real = model64(doc, mask=bw.own_chunk_mask(ids))
    assert (real.k[1][:, :, :9] - by_hand.k[1][:, :, :9]).abs().max() <= TOL
    assert (real.k[1][:, :, 9:] - by_hand.k[1][:, :, 9:]).abs().max() > 1e-2
    wrong = shift_kv(parts[2].k[1], n_pre, theta)
    assert (wrong - by_hand.k[1][:, :, 9:13]).abs().max() > 1e-2
