"""The record world and CacheBlend (handout §0.4, §5): a world where reusing chunks' KV *does* lose
something, the small LLaMA that lives in it, and the three ways to prefill a chunked context.

A document is 12 records `k v`, a fresh random key -> value mapping every time, then questions:

    k7 v19 k2 v3 k11 v8 ... k5 v14   ? k2 ? k11 ...        answer to "? k2" is v3, predicted at k2

Keys sit at even positions 0, 2, ..., 22 (no BOS), values at odd ones. Cut the 24 document tokens
into chunks of length c: a record is *split* when its value starts a chunk (key at the end of one
chunk, value at the start of the next). c = 6 (even) splits none; c = 5 splits the records whose
values sit at positions 5 and 15; c = 3 splits four.

The model (4 layers, d = 64, 4 heads of 16, 2 KV heads: 512 B of KV per token in FP16) learns an
induction circuit: an early layer lets each value remember the key before it, a later layer matches
the question's key against those memories and copies the value. A value precomputed alone at the
start of a chunk never saw its key, so under full KV reuse its record is lost (chance: 1/12).

Three prefills of [chunks ... | question], all driven through common.llama's Block.qkv / Block.attend:
  full_prefill   every token attends to everything before it (the reference)
  full_reuse     every chunk precomputed alone at position 0, K moved by shift_kv, caches concatenated
  blend          CacheBlend's selective recompute with the per-layer progressive filter (§5.3)

    python code/lecture27/blend_world.py            # train (or load) the model and check it
    python code/lecture27/blend_world.py --seeds 0-19   # the seed sweep: every seed trains (slow: ~45 s each)
"""
from __future__ import annotations

import math
import statistics
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # code/ holds `common`

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from common.checkpoints import TrainingFailed, cached_model, init_weights, train_lm  # noqa: E402
from common.llama import KVCache, Llama, LlamaConfig, causal_mask, shift_kv, single_thread  # noqa: E402

# ------------------------------------------------------------------------------------ the world
N_RECORDS = 12           # records per document
N_KEYS = 12              # key tokens k1..k12 (every document uses each key once, in random order)
N_VALUES = 16            # value tokens v1..v16 (12 distinct ones per document)
DOC_LEN = 2 * N_RECORDS  # 24 tokens: k v k v ...
MARK = 0                 # the question marker "?"
VOCAB = ["?"] + [f"k{i + 1}" for i in range(N_KEYS)] + [f"v{i + 1}" for i in range(N_VALUES)]

# ------------------------------------------------------------------------------------ training
# The recipe that makes the induction head form in a few hundred steps (see train_fn):
#  * dense signal: every document is followed by 12 questions (all its keys, shuffled), and every
#    answer position is in the loss (12 targets per 48-token sequence, not 1);
#  * initialisation at the usual 1/sqrt(fan_in) scale (common.checkpoints.init_weights: embeddings N(0, 1),
#    matrices N(0, 1/64)) instead of llama.py's N(0, 0.02): with tiny weights every hidden state looks alike and the
#    loss sits on the "uniform over the 12 values in context" plateau (ln 12 = 2.48) for thousands
#    of steps; at this scale the plateau lasts ~200 steps and then drops suddenly;
#  * AdamW (common.checkpoints.train_lm) at the full rate, after a short warmup, until the drop (held-out
#    accuracy first above 50%), then cosine decay over the `after_drop` steps that follow: the rate never
#    decays while the answers are still being learned, and a run lasts only as long as it needs;
#  * dead values brought back: below `stuck_acc` `stuck_after` steps after the drop (about one
#    initialisation in three: record_model's docstring says what goes wrong), the value tokens answered
#    below `dead_acc` get new embedding rows (reseed_values) and the same run goes on, with a one-line
#    message, up to `reseeds` times;
#  * a restart as the last resort: no drop by `drop_by`, or still stuck after the re-seeds, or short of
#    TARGET_ACC at the end: from the next initialisation of the seed, one line, up to `attempts` times;
#  * a locality penalty: LOCALITY x the mean attention weight a document token puts on tokens other
#    than itself, switched on when held-out accuracy first crosses 50% and ramped up over
#    LOCALITY_RAMP steps. Why: a pretrained LLM attends mostly to nearby tokens (and to a sink), so
#    cross-chunk attention is sparse and few tokens' KV deviate under reuse - the premise of
#    CacheBlend's HKVD tokens (§5.3, insight 1). Random records cannot teach that habit: trained
#    without the penalty (LOCALITY = 0), document tokens put 80-90% of their attention on other
#    tokens, much of it in other chunks, for no reason; every token after the first chunk deviates,
#    and the top 15% of tokens hold only about half of the deviation. A value still looks at its key:
#    the answers need it, and they outweigh the penalty. Switched on from step 0, the penalty keeps the
#    induction head from ever forming (a value must first discover that its key is worth looking at).
LOCALITY = 0.3           # exercise: set 0, rerun 04_cacheblend.py, and watch insight 1 disappear
LOCALITY_RAMP = 100
TRAIN = dict(after_drop=600, batch=32, lr=3e-3, warmup=50, min_lr_frac=0.05, embed_std=1.0,
             linear_std=0.125, eval_every=25, eval_docs=256, locality=LOCALITY, locality_ramp=LOCALITY_RAMP,
             drop_by=600, stuck_after=100, stuck_acc=0.97, dead_acc=0.9, reseeds=1, attempts=4)
RESTART_SEED_STRIDE = 1000  # attempt k of seed s starts from the initialisation and data of seed s + 1000 k
SEED = 0                 # training seed (a model per seed; the tests can run against another: L27_SEED, tests/conftest.py)
TARGET_ACC = 0.995       # full-prefill accuracy on unseen records the cached model must reach
HELDOUT_SEED = 4242      # held-out documents (training draws from its own generator)


def model_config() -> LlamaConfig:
    """The LlamaConfig defaults: 4 layers, d 64, 4 heads x 16, 2 KV heads -> 512 B/token in FP16."""
    return LlamaConfig(vocab_size=len(VOCAB))


@dataclass
class Records:
    """A batch of documents with their questions.
    tokens (B, DOC_LEN + 2Q): documents then Q questions "? k"; answers (B, Q): the value token
    expected at each question's key; asked (B, Q): which record (0..11) each question asks about."""
    tokens: torch.Tensor
    answers: torch.Tensor
    asked: torch.Tensor

    @property
    def doc(self):
        return self.tokens[:, :DOC_LEN]

    @property
    def question(self):
        return self.tokens[:, DOC_LEN:]


def sample_records(n: int, generator: torch.Generator, n_questions: int = N_RECORDS) -> Records:
    """n documents, each a fresh random mapping of 12 distinct keys to 12 distinct values, followed
    by n_questions questions about distinct records (all of them by default, in random order)."""
    g = generator
    keys = torch.rand(n, N_KEYS, generator=g).argsort(1)[:, :N_RECORDS] + 1
    values = torch.rand(n, N_VALUES, generator=g).argsort(1)[:, :N_RECORDS] + 1 + N_KEYS
    doc = torch.stack([keys, values], 2).reshape(n, DOC_LEN)
    asked = torch.rand(n, N_RECORDS, generator=g).argsort(1)[:, :n_questions]
    q = torch.stack([torch.full_like(asked, MARK), keys.gather(1, asked)], 2).reshape(n, 2 * n_questions)
    return Records(torch.cat([doc, q], 1), values.gather(1, asked), asked)


def answer_slots(n_questions: int) -> torch.Tensor:
    """Indices, within the question tokens, of the positions that predict an answer (the keys)."""
    return torch.arange(n_questions) * 2 + 1


# ------------------------------------------------------------------------------------ chunks
PREFIX = -1  # chunk id of a shared prefix (a system prompt): precomputed once, seen by every chunk


def chunk_ids(n_tokens: int, chunks) -> torch.Tensor:
    """(N,) chunk id of each context token. `chunks` is a chunk length (chunks 0, 1, ... of equal
    length, the record world) or already a (N,) tensor of ids: 0, 1, ... per chunk in order (any
    lengths), with PREFIX (-1) on leading tokens that every chunk is precomputed after."""
    return chunks if isinstance(chunks, torch.Tensor) else torch.arange(n_tokens) // chunks


def chunk_spans(ids: torch.Tensor) -> list[tuple[int, int]]:
    """[(start, end), ...] of each chunk (not the prefix), in order; a chunk is a run of equal ids."""
    edges = [0] + ((ids[1:] != ids[:-1]).nonzero().squeeze(1) + 1).tolist() + [len(ids)]
    return [(a, b) for a, b in zip(edges[:-1], edges[1:]) if ids[a] != PREFIX]


def split_records(chunk_len: int, n_records: int = N_RECORDS) -> list[int]:
    """Records whose value (position 2i+1) starts a chunk: key and value land in different chunks."""
    return [i for i in range(n_records) if (2 * i + 1) % chunk_len == 0]


def precompute_chunks(model: Llama, doc: torch.Tensor, chunks) -> KVCache:
    """Full KV reuse's cache: each chunk prefilled alone at positions 0..c-1 (as if stored earlier),
    its K moved to the chunk's real place by shift_kv (V carries no position), caches concatenated.
    With a shared prefix of P tokens (chunk id PREFIX) the prefix is prefilled once and every chunk
    after it, at positions P..P+c-1, as chunks stored behind the same system prompt would be."""
    ids = chunk_ids(doc.shape[1], chunks)
    n_pre = int((ids == PREFIX).sum())
    prefix = model(doc[:, :n_pre], last=True)[1] if n_pre else None
    caches = [prefix] if n_pre else []
    for start, end in chunk_spans(ids):
        _, c = model(doc[:, start:end], cache=prefix, last=True)  # the prefix's rows come back first: drop them
        caches.append(KVCache(k=[shift_kv(k[:, :, n_pre:], start - n_pre, model.cfg.rope_theta) for k in c.k],
                              v=[v[:, :, n_pre:] for v in c.v], pos=c.pos[n_pre:] + start - n_pre))
    return KVCache.cat(caches)


# ------------------------------------------------------------------------------------ three prefills
@torch.no_grad()
def full_prefill(model: Llama, rec: Records) -> torch.Tensor:
    """Question logits (B, 2Q, vocab) when everything is computed together."""
    logits, _ = model(rec.tokens)
    return logits[:, DOC_LEN:]


@torch.no_grad()
def full_reuse(model: Llama, rec: Records, chunk_len: int, pre: KVCache | None = None) -> torch.Tensor:
    """Question logits when the question attends to the concatenated precomputed chunks
    (`pre`, if the caller has already precomputed them)."""
    if pre is None:
        pre = precompute_chunks(model, rec.doc, chunk_len)
    logits, _ = model(rec.question, cache=pre)
    return logits


SCHEDULE = (1.25, 1.0, 0.75)  # CacheBlend's progressive filter: tokens recomputed at layers 1, 2, 3.. as r*N multiples
FLAT = (1.0,)                 # r*N at every layer


@dataclass(frozen=True)
class Rule:
    """How blend() chooses the tokens it recomputes.
    schedule: multiples of r*N recomputed at layers 1, 2, ... (the last one repeats);
    check: None -> the progressive filter (every layer ranks the tokens it recomputed and keeps the
      next layer's count); c -> layers 1..c recompute every token, layer c ranks them once and that
      set is recomputed at every later layer;
    score: which deviation from the precomputed cache ranks the tokens: "k", "v" or "kv" (the sum)."""
    schedule: tuple = SCHEDULE
    check: int | None = None
    score: str = "kv"


# The selection rules blend() knows, by name:
#  progressive  the handout's CacheBlend (§5.3): layer 0 ranks by attention deviation, then every layer
#               keeps the tokens with the largest K+V deviation, 1.25 r N -> r N -> 0.75 r N ...
#  flat         the same filter recomputing r N tokens at every layer
#  check-k/-v/-kv  one fixed set chosen at one check layer, as the released systems do: LMCache's blender
#               ranks by the *key* deviation at check layer 1 (BLEND_CHECK_LAYERS = 1, recompute ratio
#               0.15) and keeps that set; the CacheBlend repository ranks by the *value* deviation at one
#               check layer (ratio 0.16), the query always recomputed. Layers 0..1 are computed in full.
RULES = {"progressive": Rule(), "flat": Rule(FLAT),
         "check-k": Rule(FLAT, 1, "k"), "check-v": Rule(FLAT, 1, "v"), "check-kv": Rule(FLAT, 1, "kv")}


def blend_counts(n_tokens: int, ratio: float, n_layers: int, schedule=SCHEDULE, check: int | None = None) -> list[int]:
    """How many context tokens are recomputed at layers 1..L-1 (layer 0 is always computed in full).
    ceil(f * r * N) with f = 1.25, 1.0, 0.75, 0.75, ... (the schedule), never more than N and never
    growing; with a check layer c, N at layers 1..c and ceil(f r N) after it; ratio >= 1 recomputes
    every token at every layer (the filter is off)."""
    if ratio >= 1:
        return [n_tokens] * (n_layers - 1)
    out, prev = [], n_tokens
    for layer in range(1, n_layers):
        if check is not None and layer <= check:
            out.append(n_tokens)
            continue
        f = schedule[min(layer - 1, len(schedule) - 1)]
        prev = min(prev, math.ceil(f * ratio * n_tokens - 1e-9))
        out.append(prev)
    return out


def _take(x: torch.Tensor, idx: torch.Tensor, dim: int) -> torch.Tensor:
    """Gather along `dim` with per-batch indices idx (B, m)."""
    shape = [1] * x.dim()
    shape[0], shape[dim] = idx.shape
    index = idx.view(shape).expand(*[s if d != dim else idx.shape[1] for d, s in enumerate(x.shape)])
    return x.gather(dim, index)


def _keep(score: torch.Tensor, n: int, how: str, g: torch.Generator | None) -> torch.Tensor:
    """Columns (B, n) of `score` (B, m) to keep: the n largest (CacheBlend) or n at random."""
    if how == "random":
        pick = torch.rand(score.shape, generator=g).argsort(1)[:, :n]
    else:
        pick = score.topk(n, dim=1).indices
    return pick.sort(1).values


@dataclass
class BlendTrace:
    """What blend() did: the doc tokens recomputed at each layer 1..L-1 (B, n_l) (indices into the
    document), the layer-0 attention deviation (B, N), and the blended cache (context and question,
    every layer) from which decoding continues."""
    recomputed: list[torch.Tensor]
    attn_dev0: torch.Tensor
    cache: KVCache | None = None


def own_chunk_mask(ids: torch.Tensor) -> torch.Tensor:
    """(N, N) mask of "each chunk precomputed alone": causal, within the token's own chunk, plus the
    shared prefix (at its real positions; its precompute saw it just before the chunk)."""
    pos = torch.arange(len(ids))
    return causal_mask(pos, pos, ids, ids) | causal_mask(pos, pos) & (ids == PREFIX)[None, :]


@torch.no_grad()
def blend(model: Llama, rec: Records, chunks, ratio: float, select: str = "deviation",
          generator: torch.Generator | None = None, pre: KVCache | None = None,
          trace: bool = False, rule: str | Rule = "progressive"):
    """CacheBlend (§5.3): start from the precomputed chunks' KV and recompute a few tokens per layer.

    Layer 0: K, V depend only on token and position, so the precomputed ones are already right. The
      attention is not: run it twice with the same K, V, once seeing only the token's own chunk (what
      precomputation did) and once seeing everything before it. The difference is each token's
      attention deviation; the ceil(1.25 r N) largest go on to layer 1 with their full-attention output.
    Layer l >= 1: recompute K, V only for the tokens still selected (they attend to the mixed cache:
      fresh K, V for selected tokens, precomputed for the rest), rank them by ||dK||^2 + ||dV||^2
      against the precomputed K, V, and keep fewer for the next layer (r N, then 0.75 r N).
    The question's tokens are computed in full at every layer. select="random" keeps the same numbers
    of tokens chosen at random (the baseline). Returns question logits (B, Tq, vocab) [, BlendTrace].

    rule: a name in RULES (or a Rule): how many tokens each layer recomputes and how they are ranked.
    "progressive" (the default) is the filter above; "flat" keeps r N at every layer; "check-k",
    "check-v", "check-kv" compute layers 0 and 1 in full, rank by the K, V or K+V deviation at layer 1
    and recompute that one set at every later layer (LMCache's blender, the CacheBlend repository).

    rec: anything with .doc (B, N) and .question (B, Tq) tokens (a Records batch, a RAG input);
    chunks: a chunk length, or (N,) chunk ids with PREFIX on a shared prefix (see chunk_ids).
    """
    doc, question = rec.doc, rec.question
    B, N = doc.shape
    Tq = question.shape[1]
    if pre is None:
        pre = precompute_chunks(model, doc, chunks)
    rule = RULES[rule] if isinstance(rule, str) else rule
    counts = blend_counts(N, ratio, model.cfg.n_layers, rule.schedule, rule.check)
    pos_doc, pos_q = torch.arange(N), torch.arange(N, N + Tq)
    pos_all = torch.arange(N + Tq)
    ids = chunk_ids(N, chunks)

    # ---- layer 0: every token computed; attention deviation picks the first set
    blk = model.layers[0]
    x_doc, x_q = model.embed(doc), model.embed(question)
    q, k, v = blk.qkv(x_doc, pos_doc)  # equals pre.k[0], pre.v[0] (to rounding): layer 0 sees no context
    own = blk.attention(q, k, v, own_chunk_mask(ids))
    full = blk.attention(q, k, v, causal_mask(pos_doc, pos_doc))
    attn_dev0 = (full - own).pow(2).sum(-1)  # (B, N)
    qq, kq, vq = blk.qkv(x_q, pos_q)
    K, V = torch.cat([k, kq], 2), torch.cat([v, vq], 2)
    ks, vs = [K], [V]
    x_q = blk.attend(x_q, qq, K, V, causal_mask(pos_q, pos_all))
    sel = _keep(attn_dev0, counts[0], select, generator)  # (B, n1) doc indices
    # the selected tokens go on with their full-attention output (its rows of `full`)
    x_sel = blk.after_attention(_take(x_doc, sel, 1), _take(full, sel, 1))

    recomputed = []
    for layer in range(1, model.cfg.n_layers):
        blk = model.layers[layer]
        m = sel.shape[1]
        # the computed set: the selected doc tokens, then the question
        xs = torch.cat([x_sel, x_q], 1)
        ps = torch.cat([sel, pos_q.expand(B, Tq)], 1)  # (B, m + Tq) positions
        q, k, v = blk.qkv(xs, ps[:, None, :])
        k_pre, v_pre = _take(pre.k[layer], sel, 2), _take(pre.v[layer], sel, 2)
        dev_k, dev_v = (k[:, :, :m] - k_pre).pow(2).sum((1, 3)), (v[:, :, :m] - v_pre).pow(2).sum((1, 3))  # (B, m)
        dev = {"k": dev_k, "v": dev_v, "kv": dev_k + dev_v}[rule.score]
        # the mixed cache: precomputed K, V with the selected tokens' rows replaced, then the question
        idx = sel[:, None, :, None].expand(B, k.shape[1], m, k.shape[3])
        K = torch.cat([pre.k[layer].scatter(2, idx, k[:, :, :m]), k[:, :, m:]], 2)
        V = torch.cat([pre.v[layer].scatter(2, idx, v[:, :, :m]), v[:, :, m:]], 2)
        ks.append(K)
        vs.append(V)
        mask = (pos_all[None, None, :] <= ps[:, :, None])[:, None]  # (B, 1, m + Tq, N + Tq)
        xs = blk.attend(xs, q, K, V, mask)
        x_sel, x_q = xs[:, :m], xs[:, m:]
        recomputed.append(sel)
        if layer + 1 < model.cfg.n_layers:  # the filter: keep the largest deviations for the next layer
            keep = _keep(dev, counts[layer], select, generator)
            sel, x_sel = sel.gather(1, keep), _take(x_sel, keep, 1)
    logits = model.logits(x_q)
    return (logits, BlendTrace(recomputed, attn_dev0, KVCache(ks, vs, pos_all))) if trace else logits


def oracle_cache(pre: KVCache, full: KVCache, ratio: float) -> KVCache:
    """The ceiling of any selection rule at ratio r: at every layer, the ceil(r N) context tokens whose
    precomputed K, V deviate most (||dK||^2 + ||dV||^2) from the full prefill's get the full prefill's
    K, V. No compute model: a perfect selector that also recomputed them exactly. `full` may hold more
    rows than the context (a prefill of context + question): its first N are used."""
    N = pre.k[0].shape[2]
    n = min(N, math.ceil(ratio * N - 1e-9))
    ks, vs = [], []
    for kp, vp, kf, vf, dev in zip(pre.k, pre.v, full.k, full.v, cache_deviation(pre, full)):
        idx = dev.topk(n, dim=1).indices[:, None, :, None].expand(kp.shape[0], kp.shape[1], n, kp.shape[3])
        ks.append(kp.scatter(2, idx, kf.gather(2, idx)))
        vs.append(vp.scatter(2, idx, vf.gather(2, idx)))
    return KVCache(ks, vs, pre.pos)


# ------------------------------------------------------------------------------------ measuring
def answer_correct(q_logits: torch.Tensor, rec: Records) -> torch.Tensor:
    """(B, Q) bool: the arg-max at each question's key is the right value."""
    pred = q_logits[:, answer_slots(rec.answers.shape[1])].argmax(-1)
    return pred == rec.answers


def split_mask(rec: Records, chunk_len: int) -> torch.Tensor:
    """(B, Q) bool: the question asks about a split record."""
    split = torch.zeros(N_RECORDS, dtype=torch.bool)
    split[split_records(chunk_len)] = True
    return split[rec.asked]


def accuracy(correct: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    return float(correct[mask].float().mean()) if mask is not None else float(correct.float().mean())


VALUE_TOKENS = torch.arange(1 + N_KEYS, 1 + N_KEYS + N_VALUES)  # token ids of v1..v16


def value_accuracy(correct: torch.Tensor, rec: Records) -> torch.Tensor:
    """(N_VALUES,) share of the questions whose answer is v1, v2, ... that are answered right (1 for a
    value no question asks about: nothing says it is wrong)."""
    return torch.stack([correct[rec.answers == v].float().mean() if (rec.answers == v).any() else torch.ones(())
                        for v in VALUE_TOKENS])


@torch.no_grad()
def reseed_values(model: Llama, dead: torch.Tensor, alive: torch.Tensor, generator: torch.Generator) -> None:
    """Give each value token of `dead` (indices 0..15) a new embedding row: a random positive mix of
    the rows of the `alive` values, scaled to their mean norm. Layer 0 already looks at the key before
    each alive value, and it does the same for a positive mix of them, so the new row joins the
    previous-token head at once; its direction is its own, and so is its output logit (tied embeddings)."""
    E = model.embed.weight
    rows = E[VALUE_TOKENS[alive]]
    norm = rows.norm(dim=1).mean()
    for i in dead.tolist():
        mix = (torch.rand(len(alive), generator=generator)[:, None] * rows).sum(0)
        E[VALUE_TOKENS[i]] = mix * norm / mix.norm()


def heldout(n_docs: int, seed: int = HELDOUT_SEED) -> Records:
    return sample_records(n_docs, torch.Generator().manual_seed(seed))


@torch.no_grad()
def kv_deviation(model: Llama, rec: Records, chunks, pre: KVCache | None = None,
                 full: KVCache | None = None) -> torch.Tensor:
    """(L, B, N): per layer and context token, ||K_reuse - K_full||^2 + ||V_reuse - V_full||^2, the
    KV deviation of the precomputed chunks from a full prefill (zero at layer 0 by construction).
    `full` may be a full prefill's cache already at hand (its first N rows are the context's)."""
    pre = pre if pre is not None else precompute_chunks(model, rec.doc, chunks)
    full = full if full is not None else model(rec.doc, last=True)[1]
    return cache_deviation(pre, full)


def cache_deviation(pre: KVCache, full: KVCache) -> torch.Tensor:
    """(L, B, N): ||K_pre - K_full||^2 + ||V_pre - V_full||^2 per layer and token of pre's N tokens,
    against the first N rows of `full` (which may also hold a question's)."""
    N = pre.k[0].shape[2]
    return torch.stack([(kp - kf[:, :, :N]).pow(2).sum((1, 3)) + (vp - vf[:, :, :N]).pow(2).sum((1, 3))
                        for kp, vp, kf, vf in zip(pre.k, pre.v, full.k, full.v)])


def average_ranks(x: torch.Tensor) -> torch.Tensor:
    """Ranks 1..N of each row of x (B, N); tied values share the mean of the ranks they span:
    rank(x_i) = #{j: x_j < x_i} + (#{j: x_j = x_i} + 1) / 2."""
    rows = [((r[None, :] < r[:, None]).sum(1) + ((r[None, :] == r[:, None]).sum(1) + 1) / 2) for r in x]
    return torch.stack(rows).to(torch.float64)


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean over rows of Spearman's rank correlation of a and b (B, N): the Pearson correlation of
    their average ranks (ties share their mean rank). Rows where either side is constant have no
    correlation and are left out."""
    ra, rb = average_ranks(a), average_ranks(b)
    ra, rb = ra - ra.mean(-1, keepdim=True), rb - rb.mean(-1, keepdim=True)
    den = (ra.pow(2).sum(-1) * rb.pow(2).sum(-1)).sqrt()
    ok = den > 0
    return float(((ra * rb).sum(-1)[ok] / den[ok]).mean())


def top_share(dev: torch.Tensor, frac: float) -> float:
    """Mean over rows of the share of the row's total held by its top ceil(frac N) entries."""
    k = math.ceil(frac * dev.shape[1] - 1e-9)
    tot = dev.sum(1)
    ok = tot > 0
    return float((dev.sort(1, descending=True).values[:, :k].sum(1)[ok] / tot[ok]).mean())


TOP_SHARE = 0.15  # "the top 15% of tokens hold ... of the KV deviation" (§5.3, insight 1)


def deviation_top_share(model: Llama, rec: Records, chunk_len: int = 5, frac: float = TOP_SHARE) -> float:
    """Insight 1 in one number: top_share of the KV deviation (chunks of chunk_len precomputed alone
    vs full prefill), averaged over layers 1..L-1 (layer 0 never deviates)."""
    dev = kv_deviation(model, rec, chunk_len)
    return sum(top_share(dev[i], frac) for i in range(1, len(dev))) / (len(dev) - 1)


@contextmanager
def kept_attention(model: Llama):
    """Inside, every layer keeps its attention weights (Block.keep_weights: the explicit softmax)."""
    for blk in model.layers:
        blk.keep_weights = True
    try:
        yield
    finally:
        for blk in model.layers:
            blk.keep_weights, blk.weights = False, None


def attention_elsewhere(model: Llama) -> torch.Tensor:
    """(L,) mean attention weight that document tokens 1..23 put on tokens other than themselves,
    over batch and heads, from the weights of the last forward (inside kept_attention)."""
    # weights[..., 1:N, :N]: row r is token r + 1, so its own weight sits on the diagonal at offset 1
    return torch.stack([1 - blk.weights[:, :, 1:DOC_LEN, :DOC_LEN].diagonal(1, -2, -1).mean()
                        for blk in model.layers])


@torch.no_grad()
def doc_attention_elsewhere(model: Llama, rec: Records) -> list[float]:
    """Per layer, the mean attention weight document tokens put on other tokens (full prefill)."""
    with kept_attention(model):
        model(rec.doc)
        return attention_elsewhere(model).tolist()


# ------------------------------------------------------------------------------------ the model
def record_model(retrain: bool = False, seed: int | None = None, steps: int | None = None,
                 locality: float | None = None):
    """(model, meta): the record-world LLaMA, trained on first call (under a minute on one core),
    then loaded from code/checkpoints/. Refuses to cache a model that did not learn the task.
    seed: the training seed (default SEED); steps / locality: override TRAIN's after_drop / locality
    (each value is its own checkpoint).

    Why a run gets stuck (6 of the 20 first initialisations of seeds 0-19, 83-96% at drop + 100): layer 0's
    previous-token head ignores 1-4 values (attention on their key: median 0.1, the others' 0.84-0.97), so
    they are answered 9-86% right. Nothing at init marks them (embedding norm 7.7 vs 8.0, spread 0.8). The
    fix: reseed_values gives them a positive mix of the answered values' rows and the run goes on (one line):
    99.8-100% 25 steps later (fresh random rows: 87-99%), in the steps of a run that never got stuck.
    """
    seed = SEED if seed is None else seed
    T = dict(TRAIN, after_drop=steps or TRAIN["after_drop"],
             locality=TRAIN["locality"] if locality is None else locality)
    eval_rec = sample_records(T["eval_docs"], torch.Generator().manual_seed(HELDOUT_SEED + 1))

    def batch_fn(step, g):
        rec = sample_records(T["batch"], g)
        x = rec.tokens
        y = torch.zeros_like(x)
        w = torch.zeros(x.shape)
        slots = DOC_LEN + answer_slots(N_RECORDS)
        y[:, slots] = rec.answers  # every question's answer is a target ...
        w[:, slots] = 1.0          # ... and nothing else is (the documents are random)
        return x, y, w

    def attempt(model, run_seed):
        """One training run from the initialisation of run_seed. Returns (history, drop step or None,
        why it stopped: "done", "no drop" or "stuck", the re-seeds of dead values on the way)."""
        drop = []  # the step at which accuracy first crosses 50%: the locality penalty and the decay start
        reseeded = []  # {"step", "acc", "values"} of each re-seed of dead values
        mix_gen = torch.Generator().manual_seed(run_seed)

        def lr_fn(step):
            # warmup, then the full rate until the answers are learned, then cosine decay over after_drop
            if step < T["warmup"]:
                return T["lr"] * (step + 1) / T["warmup"]
            if not drop:
                return T["lr"]
            t = min(1.0, (step - drop[0]) / T["after_drop"])
            return T["lr"] * (T["min_lr_frac"] + (1 - T["min_lr_frac"]) * 0.5 * (1 + math.cos(math.pi * t)))

        def eval_fn(model, step):
            # also re-seeds the dead values' rows in place when the run is stuck; training goes on with them
            correct = answer_correct(full_prefill(model, eval_rec), eval_rec)
            acc = accuracy(correct)
            if acc >= 0.5 and not drop:
                drop.append(step)
            checks = [drop[0] + T["stuck_after"] * (j + 1) for j in range(T["reseeds"] + 1)] if drop else []
            stuck = step in checks and acc < T["stuck_acc"]
            if stuck and len(reseeded) < T["reseeds"]:
                per_value = value_accuracy(correct, eval_rec)
                dead = (per_value < T["dead_acc"]).nonzero()[:, 0]
                alive = (per_value >= T["dead_acc"]).nonzero()[:, 0]
                if len(dead) and len(alive):
                    reseed_values(model, dead, alive, mix_gen)
                    reseeded.append({"step": step, "acc": acc, "values": [VOCAB[VALUE_TOKENS[i]] for i in dead]})
                    names, lo, hi = " ".join(reseeded[-1]["values"]), per_value[dead].min(), per_value[dead].max()
                    tqdm.write(f"record world, seed {seed}: {acc:.1%} at step {step}, {names} answered {lo:.0%}"
                               + (f"-{hi:.0%}" if hi > lo else "") + ": new embedding rows, training goes on",
                               file=sys.stderr)
                    stuck = False
            why = ("no drop" if not drop and step >= T["drop_by"] else "stuck" if stuck else
                   "done" if drop and step >= drop[0] + T["after_drop"] else None)
            return {"acc": acc, "stop": why} if why else {"acc": acc}

        def locality_penalty(model, step):
            if not drop:
                return torch.zeros(())
            ramp = min(1.0, (step - drop[0]) / T["locality_ramp"])
            return T["locality"] * ramp * attention_elsewhere(model).mean()

        init_weights(model, torch.Generator().manual_seed(run_seed), T["embed_std"], T["linear_std"])
        with kept_attention(model) if T["locality"] else nullcontext():
            hist = train_lm(model, batch_fn, T["drop_by"] + T["after_drop"], T["lr"], desc="record world",
                            eval_every=T["eval_every"], eval_fn=eval_fn, seed=run_seed, lr_fn=lr_fn,
                            extra_loss=locality_penalty if T["locality"] else None)
        return hist, (drop[0] if drop else None), hist["evals"][-1].get("stop") or "done", reseeded

    def train_fn(model):
        fresh = {k: v.clone() for k, v in model.state_dict().items()}
        t0, steps_done, restarts = time.time(), 0, []
        test = heldout(2000)
        with single_thread():  # a model of d = 64 gains little from a second thread
            for k in range(T["attempts"]):
                run_seed = seed + RESTART_SEED_STRIDE * k
                model.load_state_dict(fresh)
                hist, drop, why, reseeded = attempt(model, run_seed)
                steps_done += len(hist["step"])
                acc = accuracy(answer_correct(full_prefill(model, test), test))
                if why == "done" and acc >= TARGET_ACC:
                    break
                what = (f"accuracy still below 50% at step {hist['step'][-1] + 1}" if why == "no drop" else
                        f"stuck at {hist['evals'][-1]['acc']:.1%} {hist['step'][-1] + 1 - drop} steps after the drop"
                        if why == "stuck" else
                        f"{acc:.1%} < {TARGET_ACC:.1%} held-out after {T['after_drop']} steps past the drop")
                restarts.append({"run_seed": run_seed, "why": why, "steps": len(hist["step"]), "drop_step": drop,
                                 "reseeded": reseeded})
                more = k + 1 < T["attempts"]
                print(f"record world, seed {seed}: {what}; " + (
                    f"restarting from a fresh init (attempt {k + 2} of {T['attempts']})"
                    if more else "no attempts left"), file=sys.stderr)
                if not more:
                    raise TrainingFailed(f"record world: {T['attempts']} initialisations of seed {seed} failed "
                                         f"(last: {what}). NOT caching a model. Try another --seed.")
        seconds = time.time() - t0
        metrics = {"heldout_acc": acc, "heldout_questions": test.answers.numel(), "drop_step": drop,
                   "train_seconds": seconds, "locality_from_step": drop if T["locality"] else None,
                   "steps": len(hist["step"]), "steps_total": steps_done, "run_seed": run_seed,
                   "restarts": restarts, "reseeded": reseeded,
                   "attention_elsewhere": doc_attention_elsewhere(model, test),
                   "history": {"step": hist["step"][::5], "loss": hist["loss"][::5], "extra": hist["extra"][::5],
                               "evals": [{k: v for k, v in e.items() if k != "stop"} for e in hist["evals"]]}}
        return metrics

    model, meta = cached_model("records", model_config(), T, train_fn, retrain, seed)
    return model, meta


def plot_training(meta: dict, path) -> None:
    """Loss and held-out accuracy against the step, the sudden drop marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    h = meta["metrics"]["history"]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.plot(h["step"], h["loss"], color="tab:blue", lw=1, label="training loss (answers)")
    ax.axhline(math.log(N_RECORDS), color="tab:blue", ls=":", lw=1, label="ln 12: uniform over the values in context")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats, log scale)")
    ax.set_yscale("log")  # the first steps start near 30 nats (unit-scale tied embeddings)
    ax2 = ax.twinx()
    ev = h["evals"]
    ax2.plot([e["step"] for e in ev], [e["acc"] for e in ev], color="tab:red", lw=1.5, label="held-out accuracy")
    ax2.set_ylabel("accuracy")
    ax2.set_ylim(0, 1.02)
    drop = meta["metrics"]["drop_step"]
    if drop:
        ax.axvline(drop, color="gray", ls="--", lw=1)
        ax.text(drop, ax.get_ylim()[1] * 0.9, f" accuracy > 50% at step {drop}", fontsize=8)
    start = meta["metrics"].get("locality_from_step")
    if start:
        ax.axvspan(start, start + meta["ident"]["train"]["locality_ramp"], color="tab:green", alpha=0.15,
                   label=f"locality penalty ramps up (x {meta['ident']['train']['locality']})")
    lines = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    ax.legend(lines, [ln.get_label() for ln in lines], fontsize=8, loc="center right")
    ax.set_title("record world: the induction head forms suddenly")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_seeds(text: str) -> list[int]:
    """"0-19" or "0,3,12-13" -> the seeds in order (ValueError on anything else)."""
    seeds = []
    for part in text.split(","):
        lo, dash, hi = part.strip().partition("-")
        a, b = int(lo), int(hi) if dash else int(lo)
        if a < 0 or b < a:
            raise ValueError(f"bad seed range {part!r}")
        seeds += range(a, b + 1)
    return seeds


SWEEP_DOCS = 1000  # held-out documents for each seed's deviation share (as 04_cacheblend.py's N_DOCS)


def seed_sweep(seeds, retrain: bool = False, chunk_len: int = 5) -> list[dict]:
    """Train (or load) the record model for each seed: drop step, attempts, held-out accuracy, the
    top-15% share of the KV deviation (chunks of chunk_len, layers 1-3) and training seconds."""
    rows, rec = [], heldout(SWEEP_DOCS)
    for s in seeds:
        try:
            model, meta = record_model(retrain, s)
        except TrainingFailed as e:
            rows.append({"seed": s, "failed": str(e)})
            continue
        m = meta["metrics"]
        with torch.no_grad():
            share = deviation_top_share(model, rec, chunk_len)
        rows.append({"seed": s, "drop_step": m["drop_step"], "attempts": len(m["restarts"]) + 1,
                     "reseeded": sum(len(r["values"]) for r in m.get("reseeded", [])),
                     "steps": m["steps_total"], "heldout_acc": m["heldout_acc"], "top15_share": share,
                     "train_seconds": m["train_seconds"], "ms_per_step": 1e3 * m["train_seconds"] / m["steps_total"]})
    return rows


def print_sweep(rows: list[dict]) -> None:
    from common.cli import table

    ok = [r for r in rows if "failed" not in r]
    print(table(["seed", "drop step", "attempts", "values re-seeded", "steps", "held-out acc", "top-15% share",
                 "train s", "ms/step"],
                [[r["seed"], "-", "failed", "-", "-", "-", "-", "-", "-"] if "failed" in r else
                 [r["seed"], r["drop_step"], r["attempts"], r["reseeded"], r["steps"], f"{r['heldout_acc']:.2%}",
                  f"{r['top15_share']:.1%}", f"{r['train_seconds']:.0f}", f"{r['ms_per_step']:.0f}"] for r in rows],
                title=f"record model over {len(rows)} seeds (top-15% share of the KV deviation: chunks of 5, "
                      f"layers 1-3, {SWEEP_DOCS} held-out documents)"))
    if ok:
        secs = [r["train_seconds"] for r in ok]
        print(f"held-out >= {TARGET_ACC:.1%}: {sum(r['heldout_acc'] >= TARGET_ACC for r in ok)}/{len(rows)}; "
              f"share >= 85%: {sum(r['top15_share'] >= 0.85 for r in ok)}/{len(rows)}; training s: median "
              f"{statistics.median(secs):.0f}, max {max(secs):.0f} (one thread; other processes slow it down)")
        steps, rate = [r["steps"] for r in ok], statistics.median(r["ms_per_step"] for r in ok)
        print(f"steps: median {statistics.median(steps):.0f}, max {max(steps)}; at the sweep's median "
              f"{rate:.0f} ms/step that is median {statistics.median(steps) * rate / 1e3:.0f} s, "
              f"max {max(steps) * rate / 1e3:.0f} s")


def main():
    from common.cli import Parser, fail, figure_path, nonneg_float, positive_int, write_json

    p = Parser(__doc__)
    p.add_argument("--retrain", action="store_true", help="train again even if a checkpoint exists")
    p.add_argument("--seed", type=int, default=SEED, help="training seed")
    p.add_argument("--seeds", metavar="LIST", help="train (or load) every seed of LIST (e.g. 0-19 or 0,12-13) "
                   "and print one row each: the seed sweep")
    p.add_argument("--steps", type=positive_int, default=TRAIN["after_drop"],
                   help="training steps after the drop (accuracy > 50%%)")
    p.add_argument("--locality", type=nonneg_float, default=LOCALITY, help="locality penalty weight (0: none)")
    a = p.parse_args()
    if a.seeds is not None:
        try:
            seeds = parse_seeds(a.seeds)
        except ValueError:
            fail(f"--seeds must look like 0-19 or 0,3,12-13, not {a.seeds!r}")
        rows = seed_sweep(seeds, a.retrain)
        print_sweep(rows)
        write_json(a.json, {"sweep": rows})
        return
    try:
        model, meta = record_model(a.retrain, a.seed, a.steps, a.locality)
    except TrainingFailed as e:
        print(f"\n!!! {e}\n", file=sys.stderr)
        sys.exit(1)
    m = meta["metrics"]
    print(f"record world: {model.n_params():,} parameters, KV {model.cfg.kv_bytes_per_token(2)} B/token (FP16)")
    for r in m.get("reseeded", []):
        print(f"{r['acc']:.1%} at step {r['step']}: values {' '.join(r['values'])} re-seeded, training went on")
    print(f"trained {m['steps']} steps in {m['train_seconds']:.0f} s" + (
          f" ({len(m['restarts'])} restarts, {m['steps_total']} steps in all)" if m["restarts"] else "")
          + f"; accuracy crossed 50% at step {m['drop_step']} (handout: ~5,000 of 12,000)")
    print(f"held-out accuracy, full prefill: {m['heldout_acc']:.2%} on {m['heldout_questions']} questions")
    loc = meta["ident"]["train"]["locality"]
    print(f"locality penalty {loc}" + (f" from step {m['locality_from_step']}" if loc else "") + "; document "
          f"tokens' attention on other tokens, layers 0-{len(m['attention_elsewhere']) - 1}: "
          + " ".join(f"{x:.1%}" for x in m["attention_elsewhere"]))
    path = figure_path("04_record_world_training.png")
    plot_training(meta, path)
    print(f"figure: {path}")


if __name__ == "__main__":
    main()
