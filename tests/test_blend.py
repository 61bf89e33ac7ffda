"""CacheBlend mechanics (blend_world.py), the selection rules built on it (blend_rules.py), the record
model's trainer (record_trainer.py) and the 04 script's controller.

Mechanics tests use an untrained model with weights at the training scale (attention far from uniform);
one test trains (or loads) the record-world model and checks it learned the task."""
import importlib
import math

import pytest
import torch

from lecture27 import blend_rules as rules
from lecture27 import blend_world as bw
from lecture27 import record_trainer as rt
from common.trainer import init_weights
from common.llama import Llama, rope, shift_kv

TOL = 1e-4  # logits here are O(10): float32 rounding of two different summation orders


def untrained(seed=0):
    torch.manual_seed(seed)
    m = Llama(bw.model_config()).eval()
    init_weights(m, torch.Generator().manual_seed(seed), rt.TRAIN["embed_std"], rt.TRAIN["linear_std"])
    return m


@pytest.fixture(scope="module")
def model():
    return untrained()


@pytest.fixture(scope="module")
def rec():
    return bw.heldout(8)


@pytest.mark.parametrize("chunk_len", [3, 5, 6])
def test_blend_full_ratio_is_full_prefill(model, rec, chunk_len):
    full = bw.full_prefill(model, rec)
    assert (bw.blend(model, rec, chunk_len, 1.0) - full).abs().max() <= TOL
    # and full reuse really differs from it (so the test above can fail)
    assert (bw.full_reuse(model, rec, chunk_len) - full).abs().max() > 1.0


@pytest.mark.parametrize("chunk_len", [3, 5, 6])
def test_blend_zero_ratio_is_full_reuse(model, rec, chunk_len):
    assert (bw.blend(model, rec, chunk_len, 0.0) - bw.full_reuse(model, rec, chunk_len)).abs().max() <= TOL


def test_blend_in_between_moves_towards_full_prefill(model, rec):
    full = bw.full_prefill(model, rec)
    err = [float((bw.blend(model, rec, 5, r) - full).abs().mean()) for r in (0.0, 0.3, 1.0)]
    assert err[0] > err[1] > err[2]


def test_blend_counts_follow_the_progressive_filter():
    counts = bw.PROGRESSIVE.counts
    assert counts(24, 0.2, 4) == [6, 5, 4]      # ceil(1.25 r N), ceil(r N), ceil(0.75 r N)
    assert counts(24, 0.0, 4) == [0, 0, 0]
    assert counts(24, 1.0, 4) == [24, 24, 24]
    assert counts(24, 0.9, 4) == [24, 22, 17]   # capped at N, never growing
    assert counts(100, 0.2, 6) == [25, 20, 15, 15, 15]  # the schedule's last entry repeats


def test_blend_trace_recomputes_nested_sets(model, rec):
    _, tr = bw.blend(model, rec, 5, 0.2, trace=True)
    assert [t.shape[1] for t in tr.recomputed] == [6, 5, 4]
    for a, b in zip(tr.recomputed, tr.recomputed[1:]):
        assert all(set(y.tolist()) <= set(x.tolist()) for x, y in zip(a, b))
    # layer 0's picks are the largest attention deviations; the first chunk never deviates
    assert torch.equal(tr.attn_dev0[:, :5], torch.zeros(len(rec.tokens), 5))
    # the six picked hold the largest deviations: none left out deviates more than any picked one
    picked = torch.zeros_like(tr.attn_dev0, dtype=torch.bool).scatter(1, tr.recomputed[0], True)
    for row, p in zip(tr.attn_dev0, picked):
        assert int(p.sum()) == 6 and float(row[p].min()) >= float(row[~p].max()) and float(row[p].min()) > 0


def test_random_selection_uses_the_same_counts(model, rec):
    _, tr = bw.blend(model, rec, 5, 0.2, rule=rules.Random(torch.Generator().manual_seed(0)), trace=True)
    assert [t.shape[1] for t in tr.recomputed] == [6, 5, 4]
    _, tr = bw.blend(model, rec, 5, 0.2, rule=rules.Random(torch.Generator().manual_seed(0), like=rules.FLAT),
                     trace=True)
    assert [t.shape[1] for t in tr.recomputed] == [5, 5, 5]
    # random picks are not the deviation's, and the generator's draws go on from call to call
    g = torch.Generator().manual_seed(0)
    a, b = (bw.blend(model, rec, 5, 0.2, rule=rules.Random(g), trace=True)[1].recomputed[0] for _ in range(2))
    assert not torch.equal(a, b) and not torch.equal(a, bw.blend(model, rec, 5, 0.2, trace=True)[1].recomputed[0])


def test_shift_kv_equals_recompute_at_new_position(model):
    """Exercise 5: K computed at positions 0..n-1 and rotated by 1000 theta equals K computed at
    1000..1000+n-1; V is the same at any position."""
    blk = model.layers[0]
    x = model.embed(torch.randint(0, len(bw.VOCAB), (2, 7)))
    _, k0, v0 = blk.qkv(x, torch.arange(7))
    _, k1, v1 = blk.qkv(x, torch.arange(1000, 1007))
    assert (shift_kv(k0, 1000, model.cfg.rope_theta) - k1).abs().max() <= 1e-4
    assert torch.equal(v0, v1)
    # and the rotation is not the identity
    assert (k0 - k1).abs().max() > 0.1
    assert torch.allclose(rope(k0, torch.full((7,), 0.0), model.cfg.rope_theta), k0)


@pytest.mark.parametrize("chunk_len,expected",
                         [(3, [1, 4, 7, 10]), (5, [2, 7]), (6, []), (4, []), (1, list(range(12)))])
def test_split_records(chunk_len, expected):
    assert bw.split_records(chunk_len) == expected


def test_split_records_by_brute_force():
    for c in range(1, 25):
        ids = bw.chunk_ids(bw.DOC_LEN, c)
        assert bw.split_records(c) == [i for i in range(12) if ids[2 * i] != ids[2 * i + 1]]


def test_documents_are_well_formed():
    rec = bw.sample_records(64, torch.Generator().manual_seed(1))
    doc = rec.doc
    keys, vals = doc[:, 0::2], doc[:, 1::2]
    assert ((keys >= 1) & (keys <= bw.N_KEYS)).all() and (vals > bw.N_KEYS).all()
    assert all(len(set(r.tolist())) == 12 for r in keys) and all(len(set(r.tolist())) == 12 for r in vals)
    q = rec.question
    assert (q[:, 0::2] == bw.MARK).all()
    assert torch.equal(q[:, 1::2], keys.gather(1, rec.asked))
    assert torch.equal(rec.answers, vals.gather(1, rec.asked))


def test_exercise8_controller():
    """04's exercise 8 is loading_controller.choose on the handout's numbers; a slower read falls back."""
    from lecture27 import loading_controller as lc

    cb = importlib.import_module("lecture27.blend.timing")
    ex = cb.controller_example(32, 10.0, 20.0, 0.15)
    assert (ex.choice, ex.ratio) == (lc.BLEND, 0.5)
    assert 1e3 * ex.ttft_s == 320.0 and 1e3 * ex.full_s == 640.0
    slow = cb.controller_example(32, 30.0, 20.0, 0.15)
    assert (slow.choice, slow.ratio, 1e3 * slow.ttft_s) == (lc.FULL_PREFILL, 1.0, 640.0)
    assert 1e3 * slow.stored_ttft_s == 960.0                # what blending from the SSD anyway would take


@pytest.mark.slow
def test_trained_model_reads_records_from_context():
    """The cached (or freshly trained) record-world model answers >= 99.5% of the 24,000 unseen-record
    questions the trainer checked it on (its gate: any model the recipe caches passes it; a sample of 2,400
    other questions would put a model at 99.6% below 99.5% about one time in four) under full prefill,
    loses the split records under full reuse and recovers them with CacheBlend at 20%."""
    model, meta = rt.record_model()
    gate = bw.heldout(rt.HELDOUT_DOCS)
    ok = bw.answer_correct(bw.full_prefill(model, gate), gate)
    assert ok.numel() == meta["metrics"]["heldout_questions"] >= 20_000 and bw.accuracy(ok) >= rt.TARGET_ACC
    rec = bw.heldout(200)
    split = bw.split_mask(rec, 5)
    assert bw.accuracy(bw.answer_correct(bw.full_reuse(model, rec, 5), rec), split) <= 0.2
    assert bw.accuracy(bw.answer_correct(bw.blend(model, rec, 5, 0.2), rec), split) >= 0.95
    assert meta["metrics"]["drop_step"] is not None and not math.isnan(meta["metrics"]["heldout_acc"])


@torch.no_grad()
def test_attention_elsewhere_is_one_minus_the_self_weight(model):
    """attention_elsewhere reads the kept weights: per layer, 1 - (a document token's weight on
    itself), averaged over tokens 1..23, heads and batch; the context manager clears the weights."""
    rec = bw.sample_records(3, torch.Generator().manual_seed(5))
    with rt.kept_attention(model):
        model(rec.doc)
        got = rt.attention_elsewhere(model)
        for i, blk in enumerate(model.layers):
            w = blk.weights
            own = torch.stack([w[:, :, t, t] for t in range(1, bw.DOC_LEN)])
            assert abs(float(got[i]) - float(1 - own.mean())) <= 1e-6
    assert all(not blk.keep_weights and blk.weights is None for blk in model.layers)
    assert rt.doc_attention_elsewhere(model, rec) == pytest.approx(got.tolist(), abs=1e-6)


@pytest.mark.slow
def test_trained_model_concentrates_kv_deviation():
    """Insight 1 (§5.3) on the trained record model (chunks of 5): the top 15% of document tokens hold
    >= 85% of the KV deviation in layers 1-3, and the deviation sits on the chunk-initial values; the
    locality penalty it was trained with keeps document tokens' attention on themselves in layers 1-3."""
    model, meta = rt.record_model()
    rec = bw.heldout(200)
    dev = bw.kv_deviation(model, rec, 5)
    shares = [bw.top_share(dev[i], 0.15) for i in range(1, model.cfg.n_layers)]
    assert min(shares) >= 0.85, shares
    firsts = [2 * i + 1 for i in bw.split_records(5)]
    assert float(dev[1][:, firsts].sum() / dev[1].sum()) >= 0.9
    assert max(rt.doc_attention_elsewhere(model, rec)[1:]) <= 0.05
    # the penalty came on at the first evaluation at >= 50% held-out accuracy, after a plateau below it
    evals = meta["metrics"]["history"]["evals"]
    first = next(e["step"] for e in evals if e["acc"] >= 0.5)
    assert meta["metrics"]["locality_from_step"] == first > 0
    assert all(e["acc"] < 0.5 for e in evals if e["step"] < first)


def test_cache_deviation_is_the_squared_change_of_k_and_v_per_layer_and_token():
    """One V row and one K value moved by hand: the deviation is exactly their squared change, at their
    layer, sequence and token, summed over heads and head dims; the question's rows of `full` are not read."""
    from common.llama import KVCache
    g = torch.Generator().manual_seed(0)
    k, v = ([torch.randn(2, 3, 5, 4, generator=g) for _ in range(3)] for _ in range(2))
    question = lambda: torch.randn(2, 3, 2, 4, generator=g)  # noqa: E731
    fk, fv = [torch.cat([x, question()], 2) for x in k], [torch.cat([x, question()], 2) for x in v]
    fv[1][1, 2, 3] += torch.tensor([1.0, 2.0, 0.0, 0.0])       # layer 1, sequence 1, token 3: |dV|^2 = 5
    fk[2][0, 0, 4, 0] += 3.0                                     # layer 2, sequence 0, token 4: |dK|^2 = 9
    dev = bw.cache_deviation(KVCache(k, v, torch.arange(5)), KVCache(fk, fv, torch.arange(7)))
    want = torch.zeros(3, 2, 5)
    want[1, 1, 3], want[2, 0, 4] = 5.0, 9.0
    assert dev.shape == (3, 2, 5) and torch.allclose(dev, want, atol=1e-5)


def test_deviation_top_share_is_insight_1_averaged_over_layers_1_and_up(model, rec):
    """Layer 0 never deviates (its K, V depend on token and position only), so insight 1's number is the
    mean of top_share over layers 1..L-1."""
    dev = bw.kv_deviation(model, rec, 5)
    assert float(dev[0].abs().max()) < 1e-6
    per_layer = [bw.top_share(dev[i], 0.15) for i in range(1, len(dev))]
    assert bw.deviation_top_share(model, rec, 5, 0.15) == pytest.approx(sum(per_layer) / len(per_layer))
    assert 0.15 < bw.deviation_top_share(model, rec, 5, 0.15) <= 1


def test_spearman_hand_worked():
    """Rank correlation on cases worked by hand: perfect, reversed, and ties sharing their mean rank
    (a = 1 2 2 3 -> ranks 1 2.5 2.5 4 against 1 2 3 4: 4.5 / sqrt(4.5 * 5) = 0.94868)."""
    up = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    assert bw.spearman(up, up * 10) == pytest.approx(1.0)
    assert bw.spearman(up, -up) == pytest.approx(-1.0)
    assert bw.average_ranks(torch.tensor([[1.0, 2.0, 2.0, 3.0]])).tolist() == [[1.0, 2.5, 2.5, 4.0]]
    assert bw.spearman(torch.tensor([[1.0, 2.0, 2.0, 3.0]]), up) == pytest.approx(4.5 / math.sqrt(22.5), abs=1e-12)
    # a monotone but non-linear map keeps rho = 1 (ranks, not values); a constant row is left out
    x = torch.tensor([[0.1, 5.0, 0.3, 2.0], [1.0, 1.0, 1.0, 1.0]])
    assert bw.spearman(x, x.exp()) == pytest.approx(1.0)


def test_parse_seeds():
    assert rt.parse_seeds("0-3") == [0, 1, 2, 3]
    assert rt.parse_seeds("0,12-13, 19") == [0, 12, 13, 19]
    for bad in ("3-1", "a", "-2", "1-"):
        with pytest.raises(ValueError):
            rt.parse_seeds(bad)


@pytest.mark.slow
def test_a_stuck_attempt_starts_again_then_gives_up(tmp_path, monkeypatch, capsys):
    """A training attempt that is not going anywhere (here: no drop by step 25, as the recipe is cut
    down to make the test fast) starts over from a fresh initialisation with a one-line message;
    when every attempt fails nothing is cached and TrainingFailed says so."""
    monkeypatch.setenv("L27_CHECKPOINTS", str(tmp_path))
    monkeypatch.setattr(rt, "TRAIN", dict(rt.TRAIN, drop_by=25, after_drop=25, attempts=2))
    with pytest.raises(rt.TrainingFailed, match="2 initialisations of seed 7 failed"):
        rt.record_model(seed=7)
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("record world, seed 7")]
    assert len(err) == 2 and "attempt 2 of 2" in err[0] and "no attempts left" in err[1]
    assert all(len(ln) <= 120 for ln in err)
    assert not list(tmp_path.glob("records-*.pt"))


def test_reseed_values_mixes_the_answered_rows():
    """A dead value's new embedding row is a positive mix of the alive values' rows at their mean norm;
    every other row (keys, "?", the alive values) is left as it was."""
    m = untrained(5)
    before = m.embed.weight.detach().clone()
    dead, alive = torch.tensor([2, 9]), torch.tensor([i for i in range(bw.N_VALUES) if i not in (2, 9)])
    rt.reseed_values(m, dead, alive, torch.Generator().manual_seed(0))
    E = m.embed.weight.detach()
    rows = before[bw.VALUE_TOKENS[alive]]
    changed = bw.VALUE_TOKENS[dead]
    keep = torch.ones(len(bw.VOCAB), dtype=torch.bool)
    keep[changed] = False
    assert torch.equal(E[keep], before[keep])
    for t in changed:
        assert not torch.allclose(E[t], before[t])
        assert float(E[t].norm()) == pytest.approx(float(rows.norm(dim=1).mean()), rel=1e-5)
        # 14 random rows in 64 dimensions are independent: the mix's weights are exact, and all positive
        w = torch.linalg.lstsq(rows.T, E[t][:, None]).solution[:, 0]
        assert float((rows.T @ w - E[t]).abs().max()) < 1e-4 and bool((w > 0).all())
    assert not torch.allclose(E[changed[0]], E[changed[1]])  # each dead value gets its own mix


@pytest.mark.slow
def test_a_stuck_run_reseeds_its_dead_values_and_goes_on(tmp_path, monkeypatch, capsys):
    """When held-out accuracy sits below stuck_acc stuck_after steps after the drop, the values answered
    below dead_acc (here: v3, made always wrong) get new rows, with one line, and the run goes on; still
    stuck at the next check, it is given up (here: no attempts left, nothing cached)."""
    calls = []
    real_reseed = rt.reseed_values

    def always_wrong_on_v3(q_logits, rec):
        return rec.answers != bw.VALUE_TOKENS[2]

    def spy(model, dead, alive, g):
        calls.append((dead.tolist(), alive.tolist()))
        real_reseed(model, dead, alive, g)
    monkeypatch.setenv("L27_CHECKPOINTS", str(tmp_path))
    monkeypatch.setattr(bw, "answer_correct", always_wrong_on_v3)
    monkeypatch.setattr(rt, "reseed_values", spy)
    monkeypatch.setattr(rt, "TRAIN", dict(rt.TRAIN, eval_every=5, stuck_after=10, after_drop=40, attempts=1))
    with pytest.raises(rt.TrainingFailed):
        rt.record_model(seed=4)
    assert calls == [([2], [i for i in range(bw.N_VALUES) if i != 2])]
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("record world, seed 4")]
    assert len(err) == 2 and "at step 15, v3 answered 0%: new" in err[0] and "goes on" in err[0]
    assert "stuck at" in err[1] and "20 steps after the drop" in err[1] and "no attempts left" in err[1]
    assert all(len(ln) <= 120 for ln in err)


@pytest.mark.slow
def test_each_attempt_starts_from_its_own_initialisation(tmp_path, monkeypatch):
    """Attempt k of seed s is trained from the initialisation of seed s + RESTART_SEED_STRIDE k, with
    every parameter (norm gains too) reset first: the parameters each attempt starts from are exactly
    those of a fresh model initialised with that seed."""
    starts = []
    real_init = rt.init_weights

    def spy(model, generator, *a):
        real_init(model, generator, *a)
        starts.append({k: v.clone() for k, v in model.state_dict().items()})
    monkeypatch.setenv("L27_CHECKPOINTS", str(tmp_path))
    monkeypatch.setattr(rt, "init_weights", spy)
    monkeypatch.setattr(rt, "TRAIN", dict(rt.TRAIN, drop_by=25, after_drop=25, attempts=2))
    with pytest.raises(rt.TrainingFailed):
        rt.record_model(seed=3)
    assert len(starts) == 2
    for k, got in enumerate(starts):
        ref = Llama(bw.model_config())
        real_init(ref, torch.Generator().manual_seed(3 + rt.RESTART_SEED_STRIDE * k), rt.TRAIN["embed_std"],
                  rt.TRAIN["linear_std"])
        assert all(torch.equal(got[n], v) for n, v in ref.state_dict().items())


@pytest.mark.slow
def test_train_lm_stops_when_asked_and_follows_lr_fn(monkeypatch):
    """The record trainer decides its own length and learning rate: train_lm ends after the eval
    whose result holds a true "stop", and sets each step's rate from lr_fn(step)."""
    from common.trainer import train_lm

    def batch_fn(step, g):
        x = torch.randint(0, len(bw.VOCAB), (2, 6), generator=g)
        return x, x, torch.ones(x.shape)

    torch.manual_seed(0)
    m = Llama(bw.model_config())
    rates = []
    real_step = torch.optim.AdamW.step

    def spy_step(opt, *a, **k):
        rates.append(opt.param_groups[0]["lr"])
        return real_step(opt, *a, **k)
    monkeypatch.setattr(torch.optim.AdamW, "step", spy_step)
    hist = train_lm(m, batch_fn, 100, 1.0, eval_every=5, lr_fn=lambda s: 1e-3 / (s + 1),
                    eval_fn=lambda model, step: {"stop": step == 15})
    assert hist["step"] == list(range(15)) and [e["step"] for e in hist["evals"]] == [5, 10, 15]
    assert rates == pytest.approx([1e-3 / (s + 1) for s in range(15)])


@pytest.mark.slow
def test_same_seed_same_weights(tmp_path, monkeypatch):
    """Training is reproducible on one machine: the same seed and code give bit-identical weights
    (one thread, every random draw from a seeded generator); another seed gives other weights."""
    finals = []
    real_train = rt.train_lm

    def spy(model, *a, **k):
        hist = real_train(model, *a, **k)
        finals.append({n: v.clone() for n, v in model.state_dict().items()})
        return hist
    monkeypatch.setenv("L27_CHECKPOINTS", str(tmp_path))
    monkeypatch.setattr(rt, "train_lm", spy)
    monkeypatch.setattr(rt, "TRAIN", dict(rt.TRAIN, drop_by=25, after_drop=25, attempts=1))
    for seed in (5, 5, 6):
        with pytest.raises(rt.TrainingFailed):
            rt.record_model(seed=seed)
    assert all(torch.equal(finals[0][n], finals[1][n]) for n in finals[0])
    assert not all(torch.equal(finals[0][n], finals[2][n]) for n in finals[0])


# ------------------------------------------------------------------------------------ selection rules
def test_blend_counts_of_a_check_layer_and_of_the_flat_schedule():
    assert rules.RULES["check-k"].counts(100, 0.15, 5) == [100, 15, 15, 15]
    assert rules.FLAT.counts(100, 0.15, 5) == [15, 15, 15, 15]
    check2 = rules.CheckLayer(schedule=bw.PROGRESSIVE.schedule, layer=2)
    assert check2.counts(100, 0.2, 4) == [100, 100, 15]  # after the check: the schedule's 0.75 r N
    assert rules.RULES["check-v"].counts(100, 1.0, 4) == [100, 100, 100]
    assert rules.CheckLayer(layer=5).counts(100, 0.2, 4) == [100, 100, 100]  # a check past the last layer


def test_default_rule_is_the_progressive_filter(model, rec):
    a = bw.blend(model, rec, 5, 0.2)
    assert rules.RULES["progressive"] is bw.PROGRESSIVE
    assert torch.equal(a, bw.blend(model, rec, 5, 0.2, rule=bw.Filter((1.25, 1.0, 0.75))))
    assert not torch.equal(a, bw.blend(model, rec, 5, 0.2, rule=rules.FLAT))  # the rule is really read


@torch.no_grad()
def test_blend_recomputes_what_its_rule_says(model, rec):
    """blend() asks its rule how many tokens each layer recomputes and which go on: a rule that keeps
    the n last of the tokens before it recomputes exactly those, layer by layer."""
    class Last(bw.Filter):
        def keep(self, score, n, tokens, layer):
            return torch.arange(score.shape[1] - n, score.shape[1]).expand(score.shape[0], n)

    _, tr = bw.blend(model, rec, 5, 0.25, rule=Last(schedule=(1.0, 0.5)), trace=True)
    want = [list(range(18, 24)), list(range(21, 24)), list(range(21, 24))]  # counts 6, 3, 3 of N = 24
    assert [t.tolist() for t in tr.recomputed] == [[w] * len(rec.tokens) for w in want]


@pytest.mark.parametrize("rule", list(rules.RULES))
def test_every_rule_is_full_prefill_at_ratio_one(model, rec, rule):
    full = bw.full_prefill(model, rec)
    assert (bw.blend(model, rec, 3, 1.0, rule=rules.RULES[rule]) - full).abs().max() <= TOL


def test_flat_rule_at_ratio_zero_is_full_reuse(model, rec):
    assert (bw.blend(model, rec, 3, 0.0, rule=rules.FLAT) - bw.full_reuse(model, rec, 3)).abs().max() <= TOL


@pytest.mark.parametrize("rule,score", [("check-k", "k"), ("check-v", "v"), ("check-kv", "kv")])
@torch.no_grad()
def test_check_rule_keeps_the_set_ranked_at_layer_one(model, rec, rule, score):
    """Layers 0 and 1 are computed in full, so layer 1's K, V are the full prefill's: the set is the top
    ceil(r N) tokens by that deviation from the precomputed K, V, recomputed unchanged at every later layer."""
    r, N = 0.25, bw.DOC_LEN
    _, tr = bw.blend(model, rec, 3, r, rule=rules.RULES[rule], trace=True)
    pre, full = bw.precompute_chunks(model, rec.doc, 3), model(rec.doc)[1]
    dk = (pre.k[1] - full.k[1]).pow(2).sum((1, 3))
    dv = (pre.v[1] - full.v[1]).pow(2).sum((1, 3))
    want = {"k": dk, "v": dv, "kv": dk + dv}[score].topk(math.ceil(r * N), 1).indices.sort(1).values
    assert torch.equal(tr.recomputed[0], torch.arange(N).expand(rec.doc.shape[0], N))
    for sel in tr.recomputed[1:]:
        assert torch.equal(sel, want)


@torch.no_grad()
def test_oracle_patches_the_most_deviated_rows_with_full_prefill(model, rec):
    pre, full = bw.precompute_chunks(model, rec.doc, 3), model(rec.doc)[1]
    dev = bw.kv_deviation(model, rec, 3, pre, full)  # (L, B, N)
    for r, n in [(0.0, 0), (0.25, 6), (1.0, bw.DOC_LEN)]:
        o = rules.oracle_cache(pre, full, r)
        for i in range(model.cfg.n_layers):
            top = torch.zeros_like(dev[i], dtype=torch.bool).scatter(1, dev[i].topk(n, 1).indices, True)
            same_full = ((o.k[i] == full.k[i]).all(-1) & (o.v[i] == full.v[i]).all(-1)).all(1)  # (B, N)
            same_pre = ((o.k[i] == pre.k[i]).all(-1) & (o.v[i] == pre.v[i]).all(-1)).all(1)
            assert bool(same_full[top].all()) and bool(same_pre[~top].all())
    # the oracle's cache moves the answer towards full prefill
    def err(c):
        return float((model(rec.question, cache=c)[0] - bw.full_prefill(model, rec)).abs().mean())
    assert err(rules.oracle_cache(pre, full, 0.5)) < err(pre)


# ------------------------------------------------------------------------------------ the seed sweep
@pytest.mark.slow
def test_seed_sweep_entry_point_reads_the_cached_model(tmp_path):
    """record_trainer.py --seeds: one row per seed from the cached model (no training here), with the
    deviation share measured at the sweep's chunk length, and the same rows in --json."""
    import json

    out = tmp_path / "sweep.json"
    rt.main(["--seeds", str(rt.SEED), "--no-plot", "--json", str(out)])
    rows = json.loads(out.read_text())["sweep"]
    model, meta = rt.record_model()
    assert [r["seed"] for r in rows] == [rt.SEED] and rows[0]["heldout_acc"] == meta["metrics"]["heldout_acc"]
    want = bw.deviation_top_share(model, bw.heldout(rt.SWEEP_DOCS), rt.SWEEP_CHUNK_LEN, rt.SWEEP_TOP)
    assert rows[0]["top_share"] == pytest.approx(want) and rows[0]["top_share"] >= rt.SWEEP_SHARE_BAR
    t = rt.sweep_table(rows, rt.SWEEP_CHUNK_LEN, rt.SWEEP_DOCS, rt.SWEEP_TOP)
    assert len(t.rows) == 1 and f"chunks of {rt.SWEEP_CHUNK_LEN}" in t.title


def test_seed_sweep_bad_list_is_one_line_exit_2(cli_exit):
    code, err = cli_exit("record_trainer", "--seeds", "3-1")
    assert code == 2 and "--seeds" in err and "Traceback" not in err


def test_ranked_ttft_is_the_pipeline_with_no_ranking_and_serial_with_every_layer():
    from lecture27 import loading_controller as lc
    L, load, rec, q, extra = 32, 0.010, 0.004, 0.001, 0.02
    assert lc.ranked_ttft(L, load, rec, -1, q, extra) == pytest.approx(lc.pipelined_ttft(L, load, rec, extra))
    assert lc.ranked_ttft(L, load, rec, L - 1, q, extra) == pytest.approx(L * load + L * rec + extra)
    ttft = [lc.ranked_ttft(L, load, rec, j, q, extra) for j in range(-1, L)]
    assert all(b >= a - 1e-12 for a, b in zip(ttft, ttft[1:])) and ttft[0] < ttft[-1]
    # load-bound: the recomputes of the layers already read catch up while the rest load, until they cannot
    assert ttft[1] == pytest.approx(ttft[0]) and ttft[20] > ttft[0]
    # recompute-bound: the wait for j layers adds j + 1 reads before L recomputes
    assert lc.ranked_ttft(L, 0.001, 0.004, 3, q, 0) == pytest.approx(4 * 0.001 + L * 0.004)
