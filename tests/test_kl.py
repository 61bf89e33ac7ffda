"""KL(full || other) as the scripts compute it (common.llama.kl_divergence, and where 04's city part,
codec/smollm2.py's continuation quality and blend/rag.py's item_curve call it) against
torch.nn.functional.kl_div with log_target=True and against a 2-symbol case worked by hand, in both
argument orders: KL is not symmetric, so a formula or a call with its arguments swapped (or its sign
flipped) fails here."""
import importlib
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from common.llama import Llama, LlamaConfig, kl_divergence
from common.llama import array_to_kv
from common.llama import greedy

# p = (1/2, 1/2), q = (9/10, 1/10):
#   KL(p || q) = 1/2 ln(5/9) + 1/2 ln 5            = 0.5108256
#   KL(q || p) = 9/10 ln(9/5) + 1/10 ln(1/5)       = 0.3680642
P2 = torch.tensor([0.5, 0.5]).log()
Q2 = torch.tensor([0.9, 0.1]).log()
KL_PQ = 0.5 * math.log(5 / 9) + 0.5 * math.log(5)
KL_QP = 0.9 * math.log(9 / 5) + 0.1 * math.log(1 / 5)


def reference_kl(p_log, q_log):
    """KL(p || q) per row: kl_div(input=log q, target=log p) sums p (log p - log q)."""
    return F.kl_div(q_log, p_log, log_target=True, reduction="none").sum(-1)


def test_hand_worked_values_and_the_reference_agree():
    assert KL_PQ == pytest.approx(0.5108256, abs=1e-7) and KL_QP == pytest.approx(0.3680642, abs=1e-7)
    assert float(reference_kl(P2, Q2)) == pytest.approx(KL_PQ, abs=1e-6)
    assert float(reference_kl(Q2, P2)) == pytest.approx(KL_QP, abs=1e-6)


def test_kl_divergence():
    assert float(kl_divergence(P2, Q2)) == pytest.approx(KL_PQ, abs=1e-6)
    assert float(kl_divergence(Q2, P2)) == pytest.approx(KL_QP, abs=1e-6)
    g = torch.Generator().manual_seed(0)
    p, q = (3 * torch.randn(5, 50, generator=g)).log_softmax(-1), (3 * torch.randn(5, 50, generator=g)).log_softmax(-1)
    assert torch.allclose(kl_divergence(p, q), reference_kl(p, q), atol=1e-5)
    assert torch.allclose(kl_divergence(q, p), reference_kl(q, p), atol=1e-5)
    assert (kl_divergence(p, q) - kl_divergence(q, p)).abs().max() > 0.1   # so the order is really tested


def random_model(vocab, seed, std=0.3, **kw):
    torch.manual_seed(seed)
    m = Llama(LlamaConfig(vocab_size=vocab, **kw)).eval()
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.normal_(0, std)
    return m


@torch.no_grad()
def test_codec_smollm2_continuation_kl_and_nll():
    """continuation_quality(X', ref=quality(X)) reports KL(ref || X') per token, averaged; its NLL is the
    cross-entropy of the continuation and `agree` the share of equal arg-maxes."""
    from lecture27.codec import smollm2
    from lecture27.codec import study as cs
    m = random_model(40, 1)
    g = torch.Generator().manual_seed(2)
    ctx, cont = torch.randint(0, 40, (3, 12), generator=g), torch.randint(0, 40, (3, 9), generator=g)
    X = cs.context_kv(m, ctx.numpy())
    Xn = X + np.random.default_rng(0).normal(0, 0.5, X.shape).astype(np.float32)  # a lossy codec's KV
    ref = smollm2.continuation_quality(m, X, cont)
    got = smollm2.continuation_quality(m, Xn, cont, ref)
    expect = float(reference_kl(ref["logp"], got["logp"]).mean())
    swapped = float(reference_kl(got["logp"], ref["logp"]).mean())
    assert got["kl"] == pytest.approx(expect, rel=1e-4) and abs(expect - swapped) > 1e-3 * expect > 0
    logits, _ = m(cont, cache=array_to_kv(Xn, m.cfg.n_kv_heads))
    assert got["nll"] == pytest.approx(float(F.cross_entropy(logits[:, :-1].flatten(0, 1), cont[:, 1:].flatten())),
                                       rel=1e-5)
    assert got["agree"] == pytest.approx(float((logits[:, :-1].argmax(-1) == ref["logp"].argmax(-1)).float().mean()))
    assert ref["kl"] == 0.0 and got["positions"] == 3 * 8


@torch.no_grad()
def test_04_city_kl_and_cross_entropies():
    """04's city part: KL(full prefill || full reuse) of the question tokens' next-token distributions,
    and each one's cross-entropy, against F.kl_div and F.cross_entropy on the same logits."""
    from lecture27 import blend_world as bw
    from common.city import CityLanguage, city_config
    cb = importlib.import_module("lecture27.04_cacheblend")
    lang = CityLanguage()
    cfg = city_config(lang)
    m = random_model(cfg.vocab_size, 3, std=0.15, d_model=cfg.d_model, n_layers=cfg.n_layers)
    city_reuse = importlib.import_module("lecture27.blend.city_reuse")
    got = city_reuse.city_losses(city_reuse.city_docs(m, lang, 6, 0, cb.CITY_CHUNKS, cb.CITY_CHUNK_LEN), lang,
                                 cb.CITY_CHUNK_LEN)
    # the same inputs as the script draws them
    n_ctx = cb.CITY_CHUNKS * cb.CITY_CHUNK_LEN
    x = lang.sample_text(6, cb.CITY_CHUNKS + 1, torch.Generator().manual_seed(11))
    ctx, q = x[:, :n_ctx], x[:, n_ctx:]
    full = m(x)[0][:, n_ctx:-1]
    reuse = m(q, cache=bw.precompute_chunks(m, ctx, cb.CITY_CHUNK_LEN))[0][:, :-1]
    lf, lr = full.log_softmax(-1), reuse.log_softmax(-1)
    expect, swapped = float(reference_kl(lf, lr).mean()), float(reference_kl(lr, lf).mean())
    assert got.kl == pytest.approx(expect, rel=1e-4) and abs(expect - swapped) > 1e-3 * expect > 0
    tgt = q[:, 1:].flatten()
    assert got.ce_full == pytest.approx(float(F.cross_entropy(full.flatten(0, 1), tgt)), rel=1e-5)
    assert got.ce_reuse == pytest.approx(float(F.cross_entropy(reuse.flatten(0, 1), tgt)), rel=1e-5)


@torch.no_grad()
def test_blend_rag_item_curve_reports_kl_from_full_prefill(kl_rounding):
    """item_curve's kl_first: KL(full prefill || method) of the first answer token's distribution, here
    for full reuse on a small random model with a 2-token prefix and three chunks."""
    from lecture27.blend import rag as blend_rag
    from lecture27 import blend_world as bw
    m = random_model(50, 4)
    g = torch.Generator().manual_seed(5)
    ids = torch.tensor([bw.PREFIX] * 2 + [0] * 5 + [1] * 4 + [2] * 6)
    rd = bw.RagDoc(torch.randint(0, 50, (1, len(ids)), generator=g), torch.randint(0, 50, (1, 4), generator=g),
                   ids, None)
    out = blend_rag.item_curve(m, rd, ratios=(1.0,), ratio=1.0, answer_tokens=3, kl_tokens=2)
    full = m(rd.tokens)[0][0, -1].log_softmax(-1)
    reuse = m(rd.question, cache=bw.precompute_chunks(m, rd.doc, ids))[0][0, -1].log_softmax(-1)
    expect, swapped = float(reference_kl(full, reuse)), float(reference_kl(reuse, full))
    assert out["kl_first"]["full reuse"]["0"] == pytest.approx(expect, rel=1e-4)
    assert abs(expect - swapped) > 1e-3 * expect
    full_logits = m(rd.tokens)[0][0, -1]
    assert abs(out["kl_first"]["oracle"]["1"]) < kl_rounding(full_logits)  # the full prefill's own K, V


@torch.no_grad()
def test_blend_rag_item_curve_every_method_at_every_ratio(kl_rounding):
    """item_curve shares one full prefill and one precompute across rules and ratios: every rule, random
    and the oracle get a KL at every ratio; at r = 1 every one of them is full prefill (KL 0), and the flat
    rule at r = 0 is full reuse. The greedy answers at `at` are those of the stacked (batched) decode."""
    from lecture27.blend import rag as blend_rag
    from lecture27 import blend_rules
    from lecture27 import blend_world as bw
    m = random_model(50, 4)
    g = torch.Generator().manual_seed(7)
    ids = torch.tensor([bw.PREFIX] * 2 + [0] * 6 + [1] * 5 + [2] * 7)
    rd = bw.RagDoc(torch.randint(0, 50, (1, len(ids)), generator=g), torch.randint(0, 50, (1, 4), generator=g),
                   ids, None)
    out = blend_rag.item_curve(m, rd, ratios=(0.0, 0.3, 1.0), ratio=0.3, answer_tokens=4, kl_tokens=2)
    # zero up to float32 rounding, at the first answer token and at the teacher-forced answer tokens after it
    answer = torch.tensor([out["answers"]["full prefill"][:2]])
    tol = kl_rounding(m(torch.cat([rd.tokens, answer], 1))[0][0, -3:])
    for method in [*blend_rules.RULES, "random", "oracle"]:
        assert set(out["kl_first"][method]) == set(out["kl_answer"][method]) == {"0", "0.3", "1"}
        assert abs(out["kl_first"][method]["1"]) < tol and abs(out["kl_answer"][method]["1"]) < tol
    reuse = out["kl_first"]["full reuse"]["0"]
    assert reuse > 1e-4 and out["kl_first"]["flat"]["0"] == pytest.approx(reuse, rel=1e-4)
    assert set(out["answers"]) == {"full prefill", "full reuse", *blend_rules.RULES, "random", "oracle"}
    lg, c = m(rd.question, cache=bw.precompute_chunks(m, rd.doc, ids))
    assert out["answers"]["full reuse"] == greedy(m, lg[:, -1], c, 4)[0]
