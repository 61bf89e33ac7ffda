"""The record world and CacheBlend (handout §0.4, §5.3): a world where reusing chunks' KV *does* lose
something, and the three ways to prefill a chunked context.

A document is 12 records `k v`, a fresh random key -> value mapping every time, then questions:

    k7 v19 k2 v3 k11 v8 ... k5 v14   ? k2 ? k11 ...        answer to "? k2" is v3, predicted at k2

Keys sit at even positions 0, 2, ..., 22 (no BOS), values at odd ones. Cut the 24 document tokens
into chunks of length c: a record is *split* when its value starts a chunk (key at the end of one
chunk, value at the start of the next). c = 6 (even) splits none; c = 5 splits the records whose
values sit at positions 5 and 15; c = 3 splits four.

The model (4 layers, d = 64, 4 heads of 16, 2 KV heads: 512 B of KV per token in FP16; trained by
record_trainer.py) learns an induction circuit: an early layer lets each value remember the key before
it, a later layer matches the question's key against those memories and copies the value. A value
precomputed alone at the start of a chunk never saw its key: full KV reuse loses its record (chance: 1/12).

Three prefills of [chunks ... | question], all driven through common.llama's Block.qkv / Block.attend:
  full_prefill   every token attends to everything before it (the reference)
  full_reuse     every chunk precomputed alone at position 0, K moved by shift_kv, caches concatenated
  blend          CacheBlend's selective recompute, its selection rule an argument: the handout's progressive
                 filter (§5.3) by default; blend_rules.py builds the others (flat, one check layer, random)
                 and the two oracles on it
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from common.english import RagInput
from common.llama import KVCache, Llama, LlamaConfig, causal_mask, place_chunks

# ------------------------------------------------------------------------------------ the world
N_RECORDS = 12           # records per document
N_KEYS = 12              # key tokens k1..k12 (every document uses each key once, in random order)
N_VALUES = 16            # value tokens v1..v16 (12 distinct ones per document)
DOC_LEN = 2 * N_RECORDS  # 24 tokens: k v k v ...
MARK = 0                 # the question marker "?"
VOCAB = ["?"] + [f"k{i + 1}" for i in range(N_KEYS)] + [f"v{i + 1}" for i in range(N_VALUES)]
VALUE_TOKENS = torch.arange(1 + N_KEYS, 1 + N_KEYS + N_VALUES)  # token ids of v1..v16
HELDOUT_SEED = 4242      # held-out documents (training draws from its own generator)


def model_config() -> LlamaConfig:
    """The LlamaConfig defaults: 4 layers, d 64, 4 heads x 16, 2 KV heads -> 512 B/token in FP16."""
    return LlamaConfig(vocab_size=len(VOCAB))


@dataclass
class Records:
    """A batch of documents with their questions: tokens (B, DOC_LEN + 2Q), documents then Q questions "? k";
    answers (B, Q): the value token expected at each question's key; asked (B, Q): the record (0..11) asked."""
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


def heldout(n_docs: int, seed: int = HELDOUT_SEED) -> Records:
    return sample_records(n_docs, torch.Generator().manual_seed(seed))


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


def own_chunk_mask(ids: torch.Tensor) -> torch.Tensor:
    """(N, N) mask of "each chunk precomputed alone": causal, within the token's own chunk, plus the
    shared prefix (at its real positions; its precompute saw it just before the chunk)."""
    pos = torch.arange(len(ids))
    return causal_mask(pos, pos, ids, ids) | causal_mask(pos, pos) & (ids == PREFIX)[None, :]


def precompute_chunks(model: Llama, doc: torch.Tensor, chunks) -> KVCache:
    """Full KV reuse's cache: each chunk prefilled alone at positions 0..c-1 (as if stored earlier), its K moved
    to the chunk's real place by shift_kv (V carries no position), caches concatenated. A shared prefix of P
    tokens (chunk id PREFIX) is prefilled once and every chunk after it, at P..P+c-1 (behind one system prompt)."""
    return place_chunks(stored_chunks(model, doc, chunks), model.cfg.rope_theta)


def stored_chunks(model: Llama, doc: torch.Tensor, chunks) -> list[KVCache]:
    """What a chunk store holds of this context: the shared prefix's cache (if any), then each chunk's own,
    prefilled alone behind the prefix, at P..P+c-1 (pos says so), not yet moved to its place (place_chunks)."""
    ids = chunk_ids(doc.shape[1], chunks)
    n_pre = int((ids == PREFIX).sum())
    prefix = model(doc[:, :n_pre], last=True)[1] if n_pre else None
    caches = [prefix] if n_pre else []
    for start, end in chunk_spans(ids):
        _, c = model(doc[:, start:end], cache=prefix, last=True)  # the prefix's rows come back first: drop them
        caches.append(KVCache(k=[k[:, :, n_pre:] for k in c.k], v=[v[:, :, n_pre:] for v in c.v], pos=c.pos[n_pre:]))
    return caches


# ------------------------------------------------------------------------------------ a RAG input
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
    """A RAG input (common.english.RagInput) as blend() takes it: the prefix's tokens marked PREFIX."""
    ids = [PREFIX] * len(rag.prefix) + [i for i, c in enumerate(rag.chunks) for _ in c]
    doc = rag.prefix + [t for c in rag.chunks for t in c]
    return RagDoc(torch.tensor([doc]), torch.tensor([rag.question]), torch.tensor(ids), rag)


# ------------------------------------------------------------------------------------ full prefill, full reuse
@torch.no_grad()
def full_prefill(model: Llama, rec: Records) -> torch.Tensor:
    """Question logits (B, 2Q, vocab) when everything is computed together."""
    logits, _ = model(rec.tokens)
    return logits[:, DOC_LEN:]


@torch.no_grad()
def full_reuse(model: Llama, rec: Records, chunk_len: int, pre: KVCache | None = None) -> torch.Tensor:
    """Question logits when the question attends to the concatenated precomputed chunks (`pre`, if at hand)."""
    if pre is None:
        pre = precompute_chunks(model, rec.doc, chunk_len)
    logits, _ = model(rec.question, cache=pre)
    return logits


# ------------------------------------------------------------------------------------ CacheBlend (§5.3)
@dataclass(frozen=True)
class Filter:
    """CacheBlend's progressive filter (§5.3), the selection rule blend() asks three things of (blend_rules.py's
    rules answer them otherwise; its ranking oracle ranks `tokens` by their true deviation at `layer` and after):
      counts(N, r, L)  how many context tokens layers 1..L-1 recompute: ceil(f r N) for f = 1.25, 1.0, 0.75,
                       0.75, ... (`schedule`, its last entry repeating), never more than N and never growing;
                       r >= 1 recomputes every token at every layer (the filter is off);
      score(dK, dV)    what ranks the tokens a layer has just recomputed: ||dK||^2 + ||dV||^2 against their
                       precomputed K, V;
      keep(score, n, tokens, layer)  which n of `tokens` (B, m: the document indices score's columns rank) go
                       on to be recomputed at `layer` (layer 1's from layer 0's attention deviation): the n
                       largest, in document order;
      reads_deviation  whether keep() at layer 1 reads that deviation (a rule that does not is spared its two
                       attentions over every context token).
    Two more that a rule reading the input before blend() runs answers otherwise (blend_rules.INPUT_RULES):
      ready(model, rec, chunks, pre)  the rule blend() is given for this input, after the rule's own work on
                       it: this rule as it is;
      extra_token_layers(n_question, L)  token-layers that work computes beside blend()'s: none."""
    schedule: tuple = (1.25, 1.0, 0.75)
    reads_deviation = True   # keep() at layer 1 reads layer 0's attention deviation (a rule that does not skips it)

    def counts(self, n_tokens: int, ratio: float, n_layers: int) -> list[int]:
        if ratio >= 1:
            return [n_tokens] * (n_layers - 1)
        out, prev = [], n_tokens
        for layer in range(1, n_layers):
            f = self.schedule[min(layer - 1, len(self.schedule) - 1)]
            prev = min(prev, math.ceil(f * ratio * n_tokens - 1e-9))
            out.append(prev)
        return out

    def score(self, dev_k: torch.Tensor, dev_v: torch.Tensor) -> torch.Tensor:
        return dev_k + dev_v

    def keep(self, score: torch.Tensor, n: int, tokens: torch.Tensor, layer: int) -> torch.Tensor:
        """Columns (B, n) of score (B, m) that go on: the n largest, sorted."""
        return score.topk(n, dim=1).indices.sort(1).values

    def ready(self, model, rec, chunks, pre: KVCache) -> Filter:
        return self

    def extra_token_layers(self, n_question: int, n_layers: int) -> int:
        return 0


PROGRESSIVE = Filter()  # the handout's: 1.25 r N tokens at layer 1, r N at layer 2, 0.75 r N from layer 3


@dataclass
class BlendTrace:
    """What blend() did: the doc tokens recomputed at each layer 1..L-1 (B, n_l) (indices into the document), the
    layer-0 attention deviation (B, N) (None where the rule picks without it), and the blended cache (context and
    question, every layer) to decode from."""
    recomputed: list[torch.Tensor]
    attn_dev0: torch.Tensor | None
    cache: KVCache | None = None


def position_mask(rows: torch.Tensor, n_keys: int) -> torch.Tensor:
    """(B, 1, M, n_keys) mask of the rows blend() recomputes at a layer (positions rows (B, M): the selected context
    tokens, then the question): each row sees the keys at or before its own position, whichever were selected."""
    return (torch.arange(n_keys)[None, None, :] <= rows[:, :, None])[:, None]


@torch.no_grad()
def blend(model: Llama, rec: Records, chunks, ratio: float, *, rule=PROGRESSIVE, pre: KVCache | None = None,
          trace: bool = False, mask=position_mask):
    """CacheBlend (§5.3): start from the precomputed chunks' KV and recompute a few tokens per layer.

    Layer 0: K, V depend only on token and position, so the precomputed ones are already right. The attention
      is not: run it twice with the same K, V, once seeing only the token's own chunk (what precomputation
      did) and once seeing everything before it. The difference is each token's attention deviation; the
      ceil(1.25 r N) largest go on to layer 1 with their full-attention output.
    Layer l >= 1: recompute K, V only for the tokens still selected; build the mixed cache (fresh K, V for
      them, precomputed for the rest) that they attend to; keep fewer for the next layer, those with the
      largest ||dK||^2 + ||dV||^2 against the precomputed K, V (r N, then 0.75 r N).
    The question's tokens are computed in full at every layer. `rule` says how many tokens each layer
    recomputes and which (Filter). Returns question logits (B, Tq, vocab) [, BlendTrace].
    rec: anything with .doc (B, N) and .question (B, Tq) tokens (a Records batch, a RAG input); chunks: a chunk
    length, or (N,) chunk ids with PREFIX on a shared prefix (chunk_ids); pre: the precomputed chunks, if at
    hand; mask(rows, n_keys): which keys the recomputed rows see at layers 1..L-1 (position_mask; the
    bottom-right mask of mask_pitfall.py is the pitfall beside it).
    """
    doc, question = rec.doc, rec.question
    (B, N), Tq, L = doc.shape, question.shape[1], model.cfg.n_layers
    pre = pre if pre is not None else precompute_chunks(model, doc, chunks)
    counts = rule.counts(N, ratio, L)
    pos_doc, pos_q, pos_all = torch.arange(N), torch.arange(N, N + Tq), torch.arange(N + Tq)

    # ---- layer 0: the attention deviation picks the first set
    blk = model.layers[0]
    x_doc, x_q = model.embed(doc), model.embed(question)
    q, k, v = blk.qkv(x_doc, pos_doc)  # equals pre.k[0], pre.v[0] (to rounding): layer 0 sees no context
    if getattr(rule, "reads_deviation", True):
        own = blk.attention(q, k, v, own_chunk_mask(chunk_ids(N, chunks)))
        full = blk.attention(q, k, v, causal_mask(pos_doc, pos_doc))
        attn_dev0 = (full - own).pow(2).sum(-1)  # (B, N)
        sel = rule.keep(attn_dev0, counts[0], pos_doc.expand(B, N), 1)  # (B, n1) doc indices
        full = _take(full, sel, 1)
    else:  # the rule picks without it: only the picked tokens' attention is computed
        attn_dev0 = None
        sel = rule.keep(torch.zeros(B, N), counts[0], pos_doc.expand(B, N), 1)
        rows = q.gather(2, sel[:, None, :, None].expand(-1, q.shape[1], -1, q.shape[3]))
        full = blk.attention(rows, k, v, pos_doc <= sel[:, None, :, None])
    x_sel = blk.after_attention(_take(x_doc, sel, 1), full)  # their full-attention output
    qq, kq, vq = blk.qkv(x_q, pos_q)
    ks, vs = [torch.cat([k, kq], 2)], [torch.cat([v, vq], 2)]
    x_q = blk.attend(x_q, qq, ks[0], vs[0], causal_mask(pos_q, pos_all))

    recomputed = []
    for layer in range(1, L):
        blk, m = model.layers[layer], sel.shape[1]
        # ---- recompute K, V of the selected tokens (then the question's), and how far they moved
        xs = torch.cat([x_sel, x_q], 1)
        ps = torch.cat([sel, pos_q.expand(B, Tq)], 1)  # (B, m + Tq) positions
        q, k, v = blk.qkv(xs, ps[:, None, :])
        dev = rule.score(_moved(k[:, :, :m], pre.k[layer], sel), _moved(v[:, :, :m], pre.v[layer], sel))  # (B, m)
        # ---- the mixed cache: precomputed K, V with the selected tokens' rows replaced, then the question
        ks.append(_mixed(pre.k[layer], sel, k))
        vs.append(_mixed(pre.v[layer], sel, v))
        xs = blk.attend(xs, q, ks[-1], vs[-1], mask(ps, N + Tq))
        x_sel, x_q = xs[:, :m], xs[:, m:]
        recomputed.append(sel)
        # ---- keep fewer: the largest deviations go on to the next layer
        if layer + 1 < L:
            keep = rule.keep(dev, counts[layer], sel, layer + 1)
            sel, x_sel = sel.gather(1, keep), _take(x_sel, keep, 1)
    logits = model.logits(x_q)
    return (logits, BlendTrace(recomputed, attn_dev0, KVCache(ks, vs, pos_all))) if trace else logits


def _take(x: torch.Tensor, idx: torch.Tensor, dim: int) -> torch.Tensor:
    """Gather along `dim` with per-batch indices idx (B, m)."""
    shape = [1] * x.dim()
    shape[0], shape[dim] = idx.shape
    index = idx.view(shape).expand(*[s if d != dim else idx.shape[1] for d, s in enumerate(x.shape)])
    return x.gather(dim, index)


def _moved(fresh: torch.Tensor, pre: torch.Tensor, sel: torch.Tensor) -> torch.Tensor:
    """(B, m) squared distance of the selected tokens' fresh K (or V) rows (B, H, m, hd) from their
    precomputed rows in `pre` (B, H, N, hd), summed over heads and dimensions."""
    return (fresh - _take(pre, sel, 2)).pow(2).sum((1, 3))


def _mixed(pre: torch.Tensor, sel: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
    """One layer's K (or V) as the recomputed rows attend to it: `pre` (B, H, N, hd) with the rows of
    `sel` (B, m) replaced by the first m rows of `fresh`, then the rest of `fresh` (the question)."""
    B, m = sel.shape
    idx = sel[:, None, :, None].expand(B, fresh.shape[1], m, fresh.shape[3])
    return torch.cat([pre.scatter(2, idx, fresh[:, :, :m]), fresh[:, :, m:]], 2)


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


def cache_deviation(pre: KVCache, full: KVCache) -> torch.Tensor:
    """(L, B, N): ||K_pre - K_full||^2 + ||V_pre - V_full||^2 per layer and token of pre's N tokens,
    against the first N rows of `full` (which may also hold a question's)."""
    N = pre.k[0].shape[2]
    return torch.stack([(kp - kf[:, :, :N]).pow(2).sum((1, 3)) + (vp - vf[:, :, :N]).pow(2).sum((1, 3))
                        for kp, vp, kf, vf in zip(pre.k, pre.v, full.k, full.v)])


@torch.no_grad()
def kv_deviation(model: Llama, rec: Records, chunks, pre: KVCache | None = None,
                 full: KVCache | None = None) -> torch.Tensor:
    """(L, B, N): per layer and context token, ||K_reuse - K_full||^2 + ||V_reuse - V_full||^2, the KV deviation
    of the precomputed chunks from a full prefill (zero at layer 0); `full`: a full prefill's cache, if at hand."""
    pre = pre if pre is not None else precompute_chunks(model, rec.doc, chunks)
    full = full if full is not None else model(rec.doc, last=True)[1]
    return cache_deviation(pre, full)


def average_ranks(x: torch.Tensor) -> torch.Tensor:
    """Ranks 1..N of each row of x (B, N), ties sharing their mean: #{j: x_j < x_i} + (#{j: x_j = x_i} + 1) / 2."""
    rows = [((r[None, :] < r[:, None]).sum(1) + ((r[None, :] == r[:, None]).sum(1) + 1) / 2) for r in x]
    return torch.stack(rows).to(torch.float64)


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean over rows of Spearman's rank correlation of a and b (B, N): the Pearson correlation of their average
    ranks. Rows where either side is constant have none and are left out. Insight 2: adjacent layers' rank alike."""
    ra, rb = average_ranks(a), average_ranks(b)
    ra, rb = ra - ra.mean(-1, keepdim=True), rb - rb.mean(-1, keepdim=True)
    den = (ra.pow(2).sum(-1) * rb.pow(2).sum(-1)).sqrt()
    ok = den > 0
    return float(((ra * rb).sum(-1)[ok] / den[ok]).mean())


def top_share(dev: torch.Tensor, frac: float) -> float:
    """Mean over rows of the share of the row's total held by its top ceil(frac N) entries (insight 1)."""
    k = math.ceil(frac * dev.shape[1] - 1e-9)
    tot = dev.sum(1)
    ok = tot > 0
    return float((dev.sort(1, descending=True).values[:, :k].sum(1)[ok] / tot[ok]).mean())


def deviation_top_share(model: Llama, rec: Records, chunk_len: int, frac: float) -> float:
    """Insight 1 in one number: top_share(frac) of the KV deviation (chunks of chunk_len precomputed
    alone vs full prefill), averaged over layers 1..L-1 (layer 0 never deviates)."""
    dev = kv_deviation(model, rec, chunk_len)
    return sum(top_share(dev[i], frac) for i in range(1, len(dev))) / (len(dev) - 1)
