"""The ranking oracle (blend_rules.RankingOracle) and the adaptive rule (blend_rules.Adaptive) on the record
world's blend(), with an untrained model at the training scale (as tests/test_blend.py): the oracle keeps
its rule's counts and nesting and picks by the true deviation from a full prefill."""
import math

import pytest
import torch

from lecture27 import blend_rules as rules
from lecture27 import blend_world as bw
import test_blend

TOL = test_blend.TOL
model, rec = test_blend.model, test_blend.rec  # fixtures: the untrained model, 8 documents


def true_deviation(model, rec, chunk_len):
    pre = bw.precompute_chunks(model, rec.doc, chunk_len)
    return pre, bw.kv_deviation(model, rec, chunk_len, pre)  # (L, B, N)


@pytest.mark.parametrize("like", list(rules.RULES))
def test_ranking_oracle_at_ratio_one_is_full_prefill(model, rec, like):
    pre, dev = true_deviation(model, rec, 3)
    oracle = rules.RankingOracle(rules.RULES[like], dev)
    assert (bw.blend(model, rec, 3, 1.0, rule=oracle, pre=pre) - bw.full_prefill(model, rec)).abs().max() <= TOL


@pytest.mark.parametrize("like", ["flat", "progressive"])
def test_ranking_oracle_at_ratio_zero_is_full_reuse(model, rec, like):
    pre, dev = true_deviation(model, rec, 3)
    oracle = rules.RankingOracle(rules.RULES[like], dev)
    reuse = bw.full_reuse(model, rec, 3, pre)
    assert (bw.blend(model, rec, 3, 0.0, rule=oracle, pre=pre) - reuse).abs().max() <= TOL


def ahead(dev, layer):
    """(B, N) true deviation of each token summed over layers `layer`.. (what recomputing it there removes)."""
    return dev[layer:].sum(0)


@pytest.mark.parametrize("like", list(rules.RULES))
@pytest.mark.parametrize("ratio", [0.1, 0.25, 0.5])
@torch.no_grad()
def test_ranking_oracle_recomputes_the_true_top_deviation_sets(model, rec, like, ratio):
    """Layer l recomputes counts[l-1] tokens, a subset of layer l-1's set (all tokens below layer 1), and
    every token kept there has at least the true deviation ahead of any token of that set left out."""
    rule = rules.RULES[like]
    pre, dev = true_deviation(model, rec, 3)
    _, tr = bw.blend(model, rec, 3, ratio, rule=rules.RankingOracle(rule, dev), pre=pre, trace=True)
    N, L = bw.DOC_LEN, model.cfg.n_layers
    assert [t.shape[1] for t in tr.recomputed] == rule.counts(N, ratio, L)
    below = [torch.arange(N)] * len(rec.tokens)
    for layer, sel in enumerate(tr.recomputed, start=1):
        for b in range(len(rec.tokens)):
            kept, pool = set(sel[b].tolist()), set(below[b].tolist())
            assert kept <= pool
            score = ahead(dev, layer)[b]
            out = pool - kept
            if kept and out:
                assert min(float(score[i]) for i in kept) >= max(float(score[i]) for i in out)
        below = list(sel)


@torch.no_grad()
def test_flat_ranking_oracle_keeps_one_set_the_top_by_total_deviation(model, rec):
    pre, dev = true_deviation(model, rec, 3)
    n = math.ceil(0.25 * bw.DOC_LEN)
    _, tr = bw.blend(model, rec, 3, 0.25, rule=rules.RankingOracle(rules.FLAT, dev), pre=pre, trace=True)
    want = ahead(dev, 1).topk(n, 1).indices.sort(1).values
    assert all(torch.equal(sel, want) for sel in tr.recomputed)


@torch.no_grad()
def test_ranking_oracle_ranks_better_than_the_rule_on_its_own_measure(model, rec):
    """With the same counts, the oracle's first set holds at least as much true deviation as the rule's."""
    pre, dev = true_deviation(model, rec, 3)
    _, mine = bw.blend(model, rec, 3, 0.25, rule=rules.FLAT, pre=pre, trace=True)
    _, best = bw.blend(model, rec, 3, 0.25, rule=rules.RankingOracle(rules.FLAT, dev), pre=pre, trace=True)
    held = lambda sel: float(ahead(dev, 1).gather(1, sel).sum())  # noqa: E731
    assert held(best.recomputed[0]) >= held(mine.recomputed[0])


# ------------------------------------------------------------------------------------ the adaptive rule
@pytest.mark.parametrize("layer", [0, 1])
@torch.no_grad()
def test_adaptive_keeps_the_smallest_set_holding_its_share(model, rec, layer):
    """At the check the kept set is the smallest prefix of the ranking that holds `share` of the
    measured score (for the row that needs most), never below ceil(r N); later layers keep it."""
    N, ratio = bw.DOC_LEN, 0.05
    seen = {}

    class Spy(rules.Adaptive):
        def keep(self, score, n, tokens, layer):
            out = super().keep(score, n, tokens, layer)
            seen.setdefault(layer, (score.clone(), out))
            return out

    rule = Spy(layer=layer, share=0.6)
    _, tr = bw.blend(model, rec, 3, ratio, rule=rule, trace=True)
    score, out = seen[layer + 1]
    ordered = score.sort(1, descending=True).values
    share = ordered.cumsum(1) / ordered.sum(1, keepdim=True)
    need = int((share < 0.6).sum(1).max()) + 1
    assert out.shape[1] == max(need, math.ceil(ratio * N))
    assert (score.gather(1, out).sum(1) / score.sum(1) >= 0.6 - 1e-6).all()
    assert torch.equal(out, score.topk(out.shape[1], 1).indices.sort(1).values)
    sizes = [t.shape[1] for t in tr.recomputed]
    assert sizes[:layer] == [N] * layer and set(sizes[layer:]) == {out.shape[1]}


def test_adaptive_at_ratio_one_is_full_prefill(model, rec):
    out = bw.blend(model, rec, 3, 1.0, rule=rules.Adaptive(layer=1, share=0.5))
    assert (out - bw.full_prefill(model, rec)).abs().max() <= TOL


# ------------------------------------------------------------------------------------ the studies' results
def decomposition(rule_kl, ranking, patch, reuse=1.0):
    from lecture27.blend import rag as blend_rag
    return blend_rag.Decomposition(source="test", rule="flat", n_inputs=2, reuse=reuse, rule_kl=rule_kl,
                                   ranking=ranking, patch=patch)


def test_decomposition_splits_the_distance_to_the_patch_oracle():
    d = decomposition({0.15: 0.2, 0.3: 0.05}, {0.15: 0.15, 0.3: 0.01}, {0.15: 0.05, 0.3: 0.008})
    assert d.ratios == (0.15, 0.3)
    assert d.ranking_part(0.15) == pytest.approx(0.05) and d.recompute_part(0.15) == pytest.approx(0.1)
    assert d.dominant(0.15) == "recompute" and d.dominant(0.3) == "ranking"
    assert decomposition({0.15: 0.08}, {0.15: 0.12}, {0.15: 0.09}).dominant(0.15) == "none"
    assert d.ranking_part(0.3) + d.recompute_part(0.3) == pytest.approx(d.rule_kl[0.3] - d.patch[0.3])


def test_decompose_reads_the_rules_ranking_oracle_and_the_patch_oracle():
    from lecture27.blend import rag as blend_rag
    c = blend_rag.Curves(ratios=(0.15,), methods=[], kl={"flat": {0.15: 0.3}, "oracle": {0.15: 0.1}}, kl_answer={},
                  reuse=1.0, reuse_answer=1.0, ranking={"flat": {0.15: 0.25}}, items=[{}, {}], loaded_from_cache=True,
                  compute_seconds=0.0)
    d = blend_rag.decompose(c, "flat", "test")
    assert d.ranking == {0.15: 0.25} and d.patch == {0.15: 0.1} and d.n_inputs == 2
    assert d.ranking_part(0.15) == pytest.approx(0.05) and d.recompute_part(0.15) == pytest.approx(0.15)
    assert decomposition({0.15: 0.05}, {0.15: 0.05}, {0.15: 0.05}).dominant(0.15) == "none"   # at the oracle


def test_best_rule_is_the_most_kl_removed_per_second():
    from lecture27.blend import rag as blend_rag
    best, scores = blend_rag.best_rule(ratio=0.15, methods=["full reuse", "flat", "progressive", "random"],
                                       kl_reuse=1.0, curve={"flat": {"0.15": 0.5}, "progressive": {"0.15": 0.5}},
                                       ttft={"flat": 1.0, "progressive": 2.0})
    assert best == "flat" and scores == {"flat": pytest.approx(0.5), "progressive": pytest.approx(0.25)}


def test_chunk_lengths_needed_is_the_first_ratio_reaching_the_long_chunks_kl():
    from lecture27.blend import rag as blend_rag
    long = blend_rag.ChunkLength(256, 1539, 6, decomposition({0.05: 0.3, 0.15: 0.1, 0.3: 0.05}, {}, {}), 0.6)
    short = blend_rag.ChunkLength(64, 387, 6, decomposition({0.05: 0.4, 0.15: 0.2, 0.3: 0.09}, {}, {}), 0.4)
    never = blend_rag.ChunkLength(32, 195, 6, decomposition({0.05: 0.4, 0.15: 0.3, 0.3: 0.2}, {}, {}), 0.3)
    study = blend_rag.ChunkLengths("flat", 0.15, 0.15, 256, [never, short, long])
    assert study.needed(long) == 0.15 and study.needed(short) == 0.3 and study.needed(never) is None


def test_flat_ratio_for_matches_the_mean_recomputed_share():
    from lecture27.blend import rag as blend_rag
    L, sizes = 30, [83, 67]
    for share in (0.15, 0.23, 0.4):
        r = blend_rag.flat_ratio_for(share, sizes, L)
        got = sum(blend_rag.flat_share(n, r, L) for n in sizes) / len(sizes)
        assert abs(got - share) <= 1 / min(sizes)  # one token's step at most
    assert blend_rag.flat_share(100, 0.15, L) == pytest.approx((100 + 29 * 15) / 3000)
    assert blend_rag.flat_ratio_for(1.0, [100], L) == 1.0          # recomputing everything is one of the steps


# ------------------------------------------------------------------------------------ 04's verdicts on them
@pytest.fixture(scope="module")
def cb():
    import importlib
    return importlib.import_module("lecture27.blend.rag_page")


def page_of(tables_fn, tmp_path, monkeypatch):
    from common.present import Page
    monkeypatch.setenv("L27_FIGURES", str(tmp_path))
    page = Page("04_smollm2", "test", "§5", plot=False)
    tables_fn(page)
    return page


@pytest.mark.parametrize("rule_kl,ranking,patch,word", [
    (0.12, 0.055, 0.029, "ranking dominates"),     # a rule far from its ranking oracle (the six passages)
    (0.030, 0.025, 0.011, "recompute dominates"),  # the ranking oracle far from the patch oracle
    (0.084, 0.118, 0.087, "at or past the patch oracle"),
    (0.050, 0.060, 0.020, "gains nothing"),
    (0.050, 0.020, 0.021, "whole distance is the ranking's")])
def test_split_verdict_says_what_the_numbers_say(cb, tmp_path, monkeypatch, rule_kl, ranking, patch, word):
    from types import SimpleNamespace
    d = decomposition({0.05: 0.3, 0.15: rule_kl}, {0.05: 0.2, 0.15: ranking}, {0.05: 0.1, 0.15: patch})
    page = page_of(lambda p: cb.show_real_split(p, SimpleNamespace(split=d, run=SimpleNamespace(ratio=0.15)), None),
                   tmp_path, monkeypatch)
    (t,) = page.tables
    assert word in t.notes[0]
    assert page.json()["real_dominant15"] == d.dominant(0.15)
    assert [row.cells[-1] for row in t.rows] == [d.dominant(0.05), d.dominant(0.15)]
    big = max(d.ranking_part(0.15), d.recompute_part(0.15))
    assert d.dominant(0.15) == ("none" if rule_kl <= patch else "ranking" if big == d.ranking_part(0.15)
                                else "recompute")


def test_chunk_notes_say_enough_only_where_the_ratio_matches(cb):
    from lecture27.blend import rag as blend_rag
    long = blend_rag.ChunkLength(256, 1539, 6, decomposition({0.05: 0.3, 0.15: 0.084, 0.3: 0.07}, {}, {}), 0.57)
    mid = blend_rag.ChunkLength(128, 771, 6, decomposition({0.05: 0.25, 0.15: 0.057, 0.3: 0.036}, {}, {}), 0.55)
    short = blend_rag.ChunkLength(64, 387, 6, decomposition({0.05: 0.1, 0.15: 0.086, 0.3: 0.075}, {}, {0.15: 0.082}),
                                  0.45)
    notes = cb.chunk_notes(blend_rag.ChunkLengths("flat", 0.15, 0.15, 256, [short, mid, long]))
    assert len(notes) == 2
    assert "15% is not enough: flat needs 30%" in notes[0] and "more spread" in notes[0]
    assert "15% is enough" in notes[1] and "no more spread" not in notes[0]


def test_adaptive_table_marks_the_closer_rule(cb, tmp_path, monkeypatch):
    from types import SimpleNamespace

    from lecture27.blend import rag as blend_rag
    rows = [blend_rag.Matched(target=0.5, recomputed=0.15, spread=(0.14, 0.16), kl=0.068, flat_ratio=0.12,
                              flat_recomputed=0.156, flat_kl=0.032),
            blend_rag.Matched(target=0.7, recomputed=0.23, spread=(0.22, 0.23), kl=0.020, flat_ratio=0.19,
                              flat_recomputed=0.226, flat_kl=0.029)]
    d = decomposition({0.15: 0.12}, {0.15: 0.055}, {0.15: 0.029})
    check = blend_rag.Decomposition(source="test", rule="check-kv", n_inputs=2, reuse=1.0, rule_kl={0.15: 0.096},
                                    ranking={0.15: 0.053}, patch={0.15: 0.029})
    r = SimpleNamespace(adaptive=blend_rag.RuleComparison("test", 1, 0.05, rows), split=d,
                        run=SimpleNamespace(ratio=0.15),
                        splits={"flat": d, "check-kv": check})
    (t,) = page_of(lambda p: cb.show_adaptive(p, r, None), tmp_path, monkeypatch).tables
    assert [row.cells[-1] for row in t.rows] == ["flat", "adaptive"]
    assert "at 1 of 2 matched shares" in t.notes[0] and "remove 71% of flat's distance" in t.notes[0]
    assert "no rule measured gets there (closest: check-kv 0.0960" in t.notes[0]
    good = blend_rag.Decomposition(source="test", rule="check-kv", n_inputs=2, reuse=1.0, rule_kl={0.15: 0.05},
                                   ranking={0.15: 0.053}, patch={0.15: 0.029})
    assert "check-kv gets there" in cb.ranking_room(d, 0.15, {"flat": d, "check-kv": good})
    past = decomposition({0.15: 0.084}, {0.15: 0.118}, {0.15: 0.087})
    assert "no ranking has a gap to close" in cb.ranking_room(past, 0.15, {"flat": past})
    none = decomposition({0.15: 0.05}, {0.15: 0.06}, {0.15: 0.02})
    assert "removes none" in cb.ranking_room(none, 0.15, {"flat": none})


def test_recomputed_note_says_which_layers_are_computed_in_full(cb):
    """Part 5c's recomputed shares sit above r because layer 0 (and a check-layer rule's layers up to its check)
    is computed in full: the note says so for every rule, with the share the table prints."""
    from types import SimpleNamespace

    from lecture27 import blend_rules
    n, L, r = 1539, 30, 0.15
    run = SimpleNamespace(items=[SimpleNamespace(n_context=n)], counts={m: blend_rules.ALL_RULES[m].counts(n, r, L)
                                                                         for m in blend_rules.ALL_RULE_NAMES},
                          share={m: blend_rules.work_share(n, 33, r, L, m) for m in blend_rules.ALL_RULE_NAMES})
    note = cb.recomputed_note(SimpleNamespace(run=run, n_layers=L))
    assert "flat, chunk-start: layer 0 in full, then 231 of the 1,539 tokens (15.0%) at each of layers 1-29" in note
    # the query rules: flat's counts and the question's pass, 33 tokens at layers 0-29 over 30 x 1,539
    pass_share = 33 * 30 / (30 * n)
    assert f"query, query+dev: layer 0 in full, then 231 of the 1,539 tokens (15.0%) at each of layers 1-29, + the " \
           f"question's pass over full reuse's cache ({pass_share:.1%})" in note
    assert run.share["query"] == pytest.approx(run.share["flat"] + pass_share)
    assert run.share["flat"] == pytest.approx(blend_rules.recompute_share(n, r, L, "flat"))
    assert f"(1 + 29 x 15.0%) / 30 = {run.share['flat']:.1%}" in note
    assert "check-k, check-v, check-kv: layers 0-1 in full" in note
    assert f"(2 + 28 x 15.0%) / 30 = {run.share['check-kv']:.1%}" in note and "(the first input's)" not in note


# ---------------------------------------------------------------------------- rules that read the input
def ready_blend(model, rec, chunks, ratio, rule, pre=None):
    pre = pre if pre is not None else bw.precompute_chunks(model, rec.doc, chunks)
    return bw.blend(model, rec, chunks, ratio, rule=rule.ready(model, rec, chunks, pre), pre=pre, trace=True)


@pytest.mark.parametrize("name", list(rules.INPUT_RULES))
def test_input_rule_at_ratio_one_is_full_prefill(model, rec, name):
    lg, _ = ready_blend(model, rec, 3, 1.0, rules.INPUT_RULES[name])
    assert (lg - bw.full_prefill(model, rec)).abs().max() <= TOL


@torch.no_grad()
def test_a_rule_that_does_not_read_layer_0s_deviation_gets_what_it_gets_when_it_is_computed(model, rec):
    """The query rule picks layer 1's tokens by the question's attention: blend() skips layer 0's two attentions
    over every context token and computes the picked tokens' attention alone, with the same result."""
    class Reading(rules.QueryAttention):
        reads_deviation = True

    lg, tr = ready_blend(model, rec, 3, 0.25, rules.QueryAttention())
    want, full = ready_blend(model, rec, 3, 0.25, Reading())
    assert tr.attn_dev0 is None and full.attn_dev0 is not None
    assert all(torch.equal(a, b) for a, b in zip(tr.recomputed, full.recomputed))
    assert (lg - want).abs().max() <= TOL


@pytest.mark.parametrize("name", list(rules.INPUT_RULES))
def test_input_rule_at_ratio_zero_is_full_reuse(model, rec, name):
    lg, _ = ready_blend(model, rec, 3, 0.0, rules.INPUT_RULES[name])
    assert (lg - bw.full_reuse(model, rec, 3)).abs().max() <= TOL


@torch.no_grad()
def direct_question_attention(model, pre, question, layers):
    """The question run over `pre` by the model's own forward, its softmax written out (keep_weights): the
    weights on the N context tokens at layers 1..layers, summed over heads and question tokens."""
    N = pre.k[0].shape[2]
    for blk in model.layers:
        blk.keep_weights = True
    try:
        model(question, cache=pre)
        return sum(model.layers[i].weights[..., :N].sum((1, 2)) for i in range(1, layers + 1))
    finally:
        for blk in model.layers:
            blk.keep_weights, blk.weights = False, None


@pytest.mark.parametrize("layers", [1, 2, 3])
@torch.no_grad()
def test_question_attention_is_the_softmax_of_the_questions_queries_over_full_reuse(model, rec, layers):
    pre = bw.precompute_chunks(model, rec.doc, 3)
    got = rules.question_attention(model, pre, rec.question, layers)
    want = direct_question_attention(model, pre, rec.question, layers)
    assert got.shape == (len(rec.tokens), bw.DOC_LEN)
    assert (got - want).abs().max() <= 1e-5
    # over a full prefill's cache the weights differ: the score reads the stale K, V
    full = model(rec.doc)[1]
    assert (direct_question_attention(model, full, rec.question, layers) - got).abs().max() > 1e-3


@pytest.mark.parametrize("with_dev", [False, True])
@torch.no_grad()
def test_query_rule_recomputes_the_top_tokens_of_the_questions_attention(model, rec, with_dev):
    """Flat's count at every layer, one set: the ceil(r N) tokens the question attends to most (with_dev:
    plus layer 0's attention deviation, each a share of its total), never a token whose K, V are exact."""
    r, N, L = 0.25, bw.DOC_LEN, model.cfg.n_layers
    pre = bw.precompute_chunks(model, rec.doc, 3)
    _, tr = ready_blend(model, rec, 3, r, rules.QueryAttention(with_dev=with_dev), pre)
    att = direct_question_attention(model, pre, rec.question, L - 1)
    score = att / att.sum(1, keepdim=True)
    if with_dev:
        score = score + tr.attn_dev0 / tr.attn_dev0.sum(1, keepdim=True)
    score[:, :3] = -1  # the first chunk of 3 tokens was precomputed where it stands: exact
    want = score.topk(math.ceil(r * N), 1).indices.sort(1).values
    assert [t.shape[1] for t in tr.recomputed] == rules.FLAT.counts(N, r, L)
    assert all(torch.equal(sel, want) for sel in tr.recomputed)


def test_query_rule_depth_reads_fewer_layers_and_counts_its_pass():
    q = rules.QueryAttention(layers=2)
    assert q.depth(30) == 2 and rules.QueryAttention().depth(30) == 29
    assert q.extra_token_layers(10, 30) == 30 and rules.FLAT.extra_token_layers(10, 30) == 0
    assert all(rules.RULES[m].ready(None, None, None, None) is rules.RULES[m] for m in rules.RULES)
    assert rules.ChunkStart().extra_token_layers(10, 30) == 0


def test_exact_tokens_are_the_prefix_and_the_first_chunk():
    P = bw.PREFIX
    assert rules.exact_tokens(7, torch.tensor([P, P, 0, 0, 1, 1, 2])).tolist() == [1, 1, 1, 1, 0, 0, 0]
    assert rules.exact_tokens(7, 3).tolist() == [1, 1, 1, 0, 0, 0, 0]


@torch.no_grad()
def test_chunk_start_recomputes_the_first_tokens_of_every_chunk(model, rec):
    """Chunks of 3 tokens from 24: chunks 1..7 deviate; 6 tokens (25%) are the first tokens of chunks 1-6
    (one turn, earlier chunks first); 12 tokens (50%): the first of all 7, then the second of chunks 1-5."""
    for r, want in [(0.25, [3, 6, 9, 12, 15, 18]), (0.5, [3, 4, 6, 7, 9, 10, 12, 13, 15, 16, 18, 21])]:
        _, tr = ready_blend(model, rec, 3, r, rules.ChunkStart())
        assert all(sel.tolist() == [want] * len(rec.tokens) for sel in tr.recomputed)
    P = bw.PREFIX
    ids = torch.tensor([P, 0, 0, 1, 1, 1, 1, 2, 2])  # chunk 0 is exact; chunk 2 has 2 tokens
    doc = bw.Records(torch.zeros(1, 9, dtype=torch.long), None, None)
    order = rules.ChunkStart().ready(None, doc, ids, None).order
    assert order.topk(5).indices.tolist() == [3, 7, 4, 8, 5]


def test_input_rule_tables_print_the_curves_and_the_depths(cb, tmp_path, monkeypatch):
    """Part 5j: every input rule's KL at each ratio and the share of full reuse's KL removed at r, beside flat
    and its two oracles; Part 5k: KL and TTFT over j, with its --json keys."""
    import json
    from types import SimpleNamespace

    curve = {"flat": {"0.05": 0.2, "0.15": 0.1}, "query": {"0.05": 0.15, "0.15": 0.05},
             "query+dev": {"0.05": 0.12, "0.15": 0.04}, "chunk-start": {"0.05": 0.25, "0.15": 0.2},
             "random": {"0.05": 0.3, "0.15": 0.28}, "oracle": {"0.05": 0.1, "0.15": 0.02}}
    ttft = {"flat": 1.0, "query": 1.2, "query+dev": 1.25, "chunk-start": 1.0, "query j=1": 1.05, "query j=4": 1.1}
    query = {"depths": [1, 4], "kl": {"query": [0.12, 0.06], "query+dev": [0.09, 0.05]},
             "ttft": {"query": [1.05, 1.1], "query+dev": [1.06, 1.12]}, "share": {"query": [0.2, 0.21]}}
    run = SimpleNamespace(ratios=(0.05, 0.15), ratio=0.15, kl_reuse=0.4, curve=curve, ttft=ttft, rule="query+dev",
                          share={m: 0.18 for m in ttft}, ranking={"flat": {"0.05": 0.15, "0.15": 0.06}},
                          no_prefix=None, query=query)
    page = page_of(lambda p: (cb.show_input_rules(p, SimpleNamespace(run=run), None),
                              cb.show_query_depths(p, SimpleNamespace(run=run), None)), tmp_path, monkeypatch)
    five_j, five_k = page.tables
    rows = {r.cells[0]: r.cells for r in five_j.rows}
    assert rows["query+dev"][1:4] == [0.12, 0.04, pytest.approx(0.9)]
    assert rows["ranking oracle (flat's counts)"][2] == 0.06 and rows["patch oracle"][3] == pytest.approx(0.95)
    assert "closest to full prefill: 5% query+dev, 15% query+dev." in five_j.notes
    assert "--rule query+dev at 15%: 0.0400 against flat's 0.1000 (60% less)" in five_j.notes[1]
    assert [r.cells[0] for r in five_k.rows] == [1, 4, "flat"]
    assert five_k.rows[0].cells[1:5] == [0.12, 1.05, 0.09, 1.06]
    assert "query: closer than flat first at j = 4" in five_k.notes[0]
    assert "query+dev: closer than flat first at j = 1" in five_k.notes[0]
    got = json.loads(json.dumps(page.json()))
    assert got["real_query_j"] == [1, 4] and got["real_query_kl15"] == [0.12, 0.06]
    assert got["real_query_ttft_s"] == [1.05, 1.1] and got["real_kl_removed"]["query"] == pytest.approx(0.875)
    assert rules.QUERY_RULES == ("query", "query+dev")
