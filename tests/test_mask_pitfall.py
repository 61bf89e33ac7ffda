"""The bottom-right causal mask (mask_pitfall.py) against the position mask blend uses: the position mask
gives the row-by-row reference's blend (test_blend_reference.ref_blend), the bottom-right one does not,
unless the recomputed tokens are the last ones of the context."""
import pytest
import torch

from lecture27 import blend_rules as rules
from lecture27 import blend_world as bw
from lecture27.blend import mask_pitfall as mp
import test_blend_reference as ref

model64 = ref.model64  # the reference's fixture: a float64 record-world model at the training scale
CASES, TOL, ref_blend = ref.CASES, ref.TOL, ref.ref_blend


def test_the_masks_agree_only_on_the_last_rows():
    N, Tq = 10, 3
    last = torch.tensor([[7, 8, 9, 10, 11, 12]])               # the last 3 context tokens, then the question
    assert torch.equal(mp.bottom_right_mask(last, N + Tq), bw.position_mask(last, N + Tq))
    scattered = torch.tensor([[1, 4, 8, 10, 11, 12]])          # CacheBlend's picks: anywhere in the context
    br, pos = mp.bottom_right_mask(scattered, N + Tq)[0, 0], bw.position_mask(scattered, N + Tq)[0, 0]
    assert torch.equal(br[3:], pos[3:])                         # the question's rows are right either way
    assert (br & ~pos)[:3].any() and not (pos & ~br).any()      # the picks see later keys, never fewer
    assert br[0].nonzero().max() == N - 3                        # the first pick sees up to N - m, not 1
    future = (br & ~pos).nonzero()[:, 1]
    assert (future < N).all()                                   # what it wrongly sees is context, not question


def test_future_keys_counts_the_later_keys_the_bottom_right_mask_shows_each_pick():
    N = 24
    picks = torch.tensor([[1, 4, 8, 20], [0, 2, 3, 23]])
    later = mp.bottom_right_mask(picks, N)[:, 0] & ~bw.position_mask(picks, N)[:, 0]   # (B, m, N)
    assert mp.future_keys(picks, N) == pytest.approx(float(later.sum(-1).float().mean()))


@torch.no_grad()
def test_the_first_kv_a_mask_can_change_is_that_of_first_layer_changed(model64):
    """Layer 0 is computed in full and layer 1's K, V come from layer 0's output: the two masks give the
    same K, V below FIRST_LAYER_CHANGED and different ones at it."""
    rec = bw.sample_records(2, torch.Generator().manual_seed(3), n_questions=3)
    caches = [bw.blend(model64, rec, 5, 0.2, trace=True, mask=m)[1].cache for m in mp.MASKS.values()]
    for layer in range(model64.cfg.n_layers):
        same = all(torch.equal(a[layer], b[layer]) for a, b in ((caches[0].k, caches[1].k), (caches[0].v, caches[1].v)))
        assert same == (layer < mp.FIRST_LAYER_CHANGED), layer


@torch.no_grad()
def test_position_mask_is_the_reference_and_the_bottom_right_mask_is_not(model64):
    ids = CASES["chunks of 5"]
    rec = bw.sample_records(2, torch.Generator().manual_seed(3), n_questions=3)
    logits, tr = bw.blend(model64, rec, ids, 0.2, trace=True, mask=bw.position_mask)
    wrong, tr_wrong = bw.blend(model64, rec, ids, 0.2, trace=True, mask=mp.bottom_right_mask)
    for b in range(2):
        sels = [s[b].tolist() for s in tr.recomputed]
        assert sels[0] != list(range(bw.DOC_LEN - len(sels[0]), bw.DOC_LEN))   # not the last tokens
        ref, _, _ = ref_blend(model64, rec.doc[b].tolist(), rec.question[b].tolist(), ids.tolist(), sels)
        assert (logits[b] - ref).abs().max() <= TOL
        # the same first picks (layer 0 is unmasked), then a different blend
        assert tr_wrong.recomputed[0][b].tolist() == sels[0]
        ref_w, _, _ = ref_blend(model64, rec.doc[b].tolist(), rec.question[b].tolist(), ids.tolist(),
                                [s[b].tolist() for s in tr_wrong.recomputed])
        assert (wrong[b] - ref_w).abs().max() > 1e-3


@torch.no_grad()
def test_the_masks_agree_when_the_picks_are_the_last_tokens(model64):
    class Last(bw.Filter):
        def keep(self, score, n, tokens, layer):
            return torch.arange(score.shape[1] - n, score.shape[1]).expand(score.shape[0], n)

    # at layer 0 the picks are indices into the document: the last n tokens; later layers keep their last n
    rec = bw.sample_records(2, torch.Generator().manual_seed(5), n_questions=3)
    rule = Last(schedule=(1.0,))
    a, tr = bw.blend(model64, rec, 5, 0.3, rule=rule, trace=True)
    b = bw.blend(model64, rec, 5, 0.3, rule=rule, mask=mp.bottom_right_mask)
    assert tr.recomputed[0][0].tolist() == list(range(bw.DOC_LEN - tr.recomputed[0].shape[1], bw.DOC_LEN))
    assert (a - b).abs().max() <= TOL


def test_blend_uses_the_position_mask_by_default(model64):
    rec = bw.sample_records(1, torch.Generator().manual_seed(7), n_questions=2)
    assert torch.equal(bw.blend(model64, rec, 5, 0.2), bw.blend(model64, rec, 5, 0.2, mask=bw.position_mask))
    assert list(mp.MASKS) == ["position", "bottom-right"] and mp.MASKS["position"] is bw.position_mask


@pytest.mark.parametrize("rule", ["flat", "check-k"])
def test_the_pitfall_is_a_mask_of_any_rule(model64, rule):
    rec = bw.sample_records(1, torch.Generator().manual_seed(8), n_questions=2)
    a = bw.blend(model64, rec, 5, 0.2, rule=rules.RULES[rule])
    b = bw.blend(model64, rec, 5, 0.2, rule=rules.RULES[rule], mask=mp.bottom_right_mask)
    assert (a - b).abs().max() > 1e-4


@pytest.mark.slow
def test_record_cost_reports_both_masks_and_the_layers_read():
    """The record world's answers to split records read the context's KV of layers 0-1 (the model's copy
    happens there); a chunk length that splits no record has no split accuracy and reads nothing."""
    from lecture27 import record_trainer as rt

    model, _ = rt.record_model()
    rec = bw.heldout(100)
    cost = mp.record_cost(model, rec, 5, 0.2)
    assert set(cost.split) == set(cost.unsplit) == set(mp.MASKS)
    assert cost.split["position"] >= 0.9
    assert cost.layers_read is not None and 1 <= cost.layers_read <= model.cfg.n_layers
    # the fewest layers of full prefill's KV (full reuse's above) that answer as well as full prefill
    split, pre = bw.split_mask(rec, 5), bw.precompute_chunks(model, rec.doc, 5)
    full, target = model(rec.doc)[1], bw.accuracy(bw.answer_correct(bw.full_prefill(model, rec), rec), split)

    def answered(n):
        cache = type(pre)(full.k[:n] + pre.k[n:], full.v[:n] + pre.v[n:], full.pos)
        return bw.accuracy(bw.answer_correct(model(rec.question, cache=cache)[0], rec), split)
    n = cost.layers_read
    assert answered(n) >= target and (n == 1 or answered(n - 1) < target)
    six = mp.record_cost(model, rec, 6, 0.2)
    assert six.layers_read is None and six.split == {"position": None, "bottom-right": None}
