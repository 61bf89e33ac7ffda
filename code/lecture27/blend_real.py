"""CacheBlend on a real pretrained LLaMA: SmolLM2-135M-Instruct on RAG inputs (handout §5).

The same functions as the record world (blend_world.py: precompute_chunks, blend, kv_deviation),
driven with a RAG input instead of a Records batch:

    context = chat prefix (3 tokens) + 6 chunks x 512 tokens, then the question (21-33 tokens)

The chat prefix "<|im_start|>user\\n" is a *shared prefix* (chunk id PREFIX): it is prefilled once and
every chunk is precomputed after it, at positions 3..514, as chunks stored behind the same system
prompt would be; shift_kv then moves each chunk's K to its real place. (Precomputed alone at
position 0, each chunk's first token would become an attention sink of its own.)

Four prefills of the same input, each giving the first answer token's distribution and a KV cache
to decode from:
  full prefill   everything computed together (the reference)
  full reuse     the precomputed chunks' KV as they are; only the question is computed
  CacheBlend r   blend(): recompute the tokens with the largest deviation, per layer
  random r       the same numbers of tokens, chosen at random

Measured: KL(full || method) of the first answer token and, teacher-forced on the full prefill's
greedy answer, of the first KL_TOKENS answer tokens; greedy answers; the KV deviation of full reuse
(per layer, per token); and wall-clock TTFT of full prefill vs CacheBlend with the chunks' KV already
in memory. The question is used at its natural length (not padded to 32 tokens; it is < 1% of the
3,100 tokens, so this changes the TTFT ratio by < 1%); the lengths are reported.

    python code/lecture27/04_cacheblend.py --model smollm2    # runs it and prints the tables (Part 5)
"""
from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # code/ holds `common`

import torch  # noqa: E402

import blend_world as bw  # noqa: E402
from common.english import RAG_ITEMS, RagInput, rag_chunks  # noqa: E402
from common.llama import kl_divergence, shift_kv  # noqa: E402

ANSWER_TOKENS = 20    # greedy answer length
KL_TOKENS = 8         # answer tokens over which the KL is also averaged (teacher-forced)
SEED = 0


@dataclass
class RagDoc:
    """A RAG input as blend() takes it: doc (1, N) = prefix + chunks, question (1, Tq), chunk ids (N,)
    with bw.PREFIX on the shared prefix."""
    doc: torch.Tensor
    question: torch.Tensor
    chunks: torch.Tensor
    rag: RagInput

    @property
    def tokens(self):
        return torch.cat([self.doc, self.question], 1)


def rag_doc(rag: RagInput) -> RagDoc:
    ids = [bw.PREFIX] * len(rag.prefix) + [i for i, c in enumerate(rag.chunks) for _ in c]
    doc = rag.prefix + [t for c in rag.chunks for t in c]
    return RagDoc(torch.tensor([doc]), torch.tensor([rag.question]), torch.tensor(ids), rag)


# ------------------------------------------------------------------------------------ decoding
@torch.no_grad()
def greedy(model, logits: torch.Tensor, cache, n: int, stop: int | None = None) -> list[int]:
    """Greedy continuation from the first answer token's logits (1, vocab) and the cache before it."""
    out = []
    for _ in range(n):
        t = int(logits.argmax(-1))
        out.append(t)
        if t == stop:
            break
        lg, cache = model(torch.tensor([[t]]), cache=cache)
        logits = lg[:, -1]
    return out


@torch.no_grad()
def answer_logprobs(model, logits: torch.Tensor, cache, answer: list[int]) -> torch.Tensor:
    """(len(answer), vocab) log-probabilities of each answer token's distribution, teacher-forced:
    the first from `logits`, the rest from feeding answer[:-1] after `cache`."""
    rows = [logits]
    if len(answer) > 1:
        lg, _ = model(torch.tensor([answer[:-1]]), cache=cache)
        rows.append(lg[0])
    return torch.cat(rows).log_softmax(-1)


# ------------------------------------------------------------------------------------ one item
def _timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


@torch.no_grad()
def run_item(model, rd: RagDoc, ratio: float, seed: int = SEED, answer_tokens: int = ANSWER_TOKENS,
             kl_tokens: int = KL_TOKENS, eos: int | None = None) -> dict:
    """The four prefills of one RAG input: KLs to full prefill, greedy answers, deviation, timings."""
    N = rd.doc.shape[1]
    (lg, full_cache), t_full = _timed(lambda: model(rd.tokens))
    first = {"full prefill": (lg[:, -1], full_cache)}
    pre, t_pre = _timed(lambda: bw.precompute_chunks(model, rd.doc, rd.chunks))
    # placing the stored chunks: shift_kv of every layer's K (already done inside precompute_chunks;
    # timed again here so that the blend's TTFT includes it)
    _, t_shift = _timed(lambda: [shift_kv(k, 1000, model.cfg.rope_theta) for k in pre.k])
    lg, c = model(rd.question, cache=pre)
    first["full reuse"] = (lg[:, -1], c)
    (lg, tr), t_blend = _timed(lambda: bw.blend(model, rd, rd.chunks, ratio, pre=pre, trace=True))
    first[f"CacheBlend {ratio:.0%}"] = (lg[:, -1], tr.cache)
    g = torch.Generator().manual_seed(seed)
    lg, trr = bw.blend(model, rd, rd.chunks, ratio, select="random", generator=g, pre=pre, trace=True)
    first[f"random {ratio:.0%}"] = (lg[:, -1], trr.cache)

    answers = {name: greedy(model, lgt, cache, answer_tokens, eos) for name, (lgt, cache) in first.items()}
    ref = answers["full prefill"][:kl_tokens]
    lp = {name: answer_logprobs(model, lgt, cache, ref) for name, (lgt, cache) in first.items()}
    out = {"kl_first": {n: float(kl_divergence(lp["full prefill"][0], v[0])) for n, v in lp.items()},
           "kl_answer": {n: float(kl_divergence(lp["full prefill"], v).mean()) for n, v in lp.items()},
           "answers": answers,
           "deviation": bw.kv_deviation(model, rd, rd.chunks, pre, full_cache)[:, 0],  # (L, N)
           "n_context": N, "n_question": rd.question.shape[1],
           "t_full": t_full, "t_blend": t_blend + t_shift, "t_precompute": t_pre}
    return out


def real_experiment(model, tok, n_items: int, ratio: float, seed: int = SEED,
                    n_chunks: int | None = None, chunk_tokens: int | None = None, progress: bool = True) -> dict:
    """run_item on the first n_items RAG items (english.RAG_ITEMS); per-item results and summaries.
    TTFT: median over the items of full prefill and of CacheBlend (shift_kv + blend), measured in
    this run at torch.get_num_threads() threads."""
    from tqdm import tqdm

    kw = {k: v for k, v in (("n_chunks", n_chunks), ("chunk_tokens", chunk_tokens)) if v is not None}
    if n_chunks is not None:  # the key passages in the second and the last chunk
        kw["key_chunks"] = (1, n_chunks - 1)
    eos = tok.token_to_id("<|im_end|>")
    items = []
    for it in tqdm(RAG_ITEMS[:n_items], desc="SmolLM2 RAG items", disable=not progress):
        rd = rag_doc(rag_chunks(it, tok, **kw))
        r = run_item(model, rd, ratio, seed, eos=eos)
        r["item"] = it
        r["text"] = {n: tok.decode(a) for n, a in r["answers"].items()}
        items.append(r)
    names = list(items[0]["kl_first"])
    mean = lambda key, n: statistics.fmean(r[key][n] for r in items)  # noqa: E731
    t_full = statistics.median(r["t_full"] for r in items)
    t_blend = statistics.median(r["t_blend"] for r in items)
    return {"items": items, "names": names, "threads": torch.get_num_threads(), "kl_tokens": KL_TOKENS,
            "kl_first": {n: mean("kl_first", n) for n in names},
            "kl_answer": {n: mean("kl_answer", n) for n in names},
            "same_answer": {n: sum(r["answers"][n] == r["answers"]["full prefill"] for r in items) for n in names},
            "t_full": t_full, "t_blend": t_blend, "ttft_speedup": t_full / t_blend,
            "deviation": torch.stack([r["deviation"] for r in items], 1)}  # (L, items, N)
