"""CacheBlend on a real pretrained LLaMA: SmolLM2-135M-Instruct on RAG inputs (handout §5).

The same functions as the record world (blend_world.py: precompute_chunks, blend, kv_deviation) and
the selection rules built on blend (blend_rules.py), driven with a RAG input instead of a Records batch:

    context = chat prefix (3 tokens) + 6 chunks x 256 tokens (04's REAL_CHUNK_TOKENS), then the
              question (21-33 tokens)

The chat prefix "<|im_start|>user\\n" is a *shared prefix* (chunk id PREFIX): it is prefilled once and
every chunk is precomputed after it, at positions 3.., as chunks stored behind the same system prompt
would be; shift_kv then moves each chunk's K to its real place. (Precomputed alone at position 0, each
chunk's first token would become an attention sink of its own.)

Prefills of the same input, each giving the first answer token's distribution and a KV cache to
decode from, all sharing one full prefill and one precompute of the chunks:
  full prefill   everything computed together (the reference)
  full reuse     the precomputed chunks' KV as they are; only the question is computed
  CacheBlend r   blend() with one of its selection rules (blend_rules.RULES)
  random r       r N tokens at every layer, chosen at random
  oracle r       the full prefill's own K, V for the r N most deviated tokens of every layer (a ceiling)

Measured: KL(full || method) of the first answer token and, teacher-forced on the full prefill's
greedy answer, of the first KL_TOKENS answer tokens; greedy answers; the KV deviation of full reuse
(per layer, per token); and wall-clock TTFT of full prefill vs each rule with the chunks' KV already
in memory. The question is used at its natural length (not padded to 32 tokens); the lengths are
reported. The default run measures one rule at one ratio; the curve (every rule at 5-50%) is opt-in.

    python code/lecture27/04_cacheblend.py --model smollm2            # runs it and prints the tables (Part 5)
    python code/lecture27/04_cacheblend.py --model smollm2 --curve    # every rule at 5-50% and the oracle
"""
from __future__ import annotations

import hashlib
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # code/ holds `common`

import torch  # noqa: E402

import blend_rules  # noqa: E402
import blend_world as bw  # noqa: E402
from common.english import CHAT_PREFIX, RAG_ITEMS, RagInput, RagItem, question_text, rag_chunks  # noqa: E402
from common.llama import KVCache, kl_divergence, shift_kv, single_thread  # noqa: E402

ANSWER_TOKENS = 20    # greedy answer length
KL_TOKENS = 8         # answer tokens over which the KL is also averaged (teacher-forced)
SEED = 0
RULE_NAMES = tuple(blend_rules.RULES)  # blend()'s selection rules, all measured
RANDOM_RULE = "flat"  # the random baseline: r N tokens at every layer chosen at random (the oracle's budget)


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


def passage_input(item: RagItem, tok) -> RagInput:
    """The student's own passages as a RAG input: chat prefix, each passage one chunk tokenized alone at
    its natural length (its text + a blank line, as the built-in chunks' paragraphs), the question."""
    chunks = [tok.encode(p.strip() + "\n\n").ids for p in item.distractors]
    return RagInput(tok.encode(CHAT_PREFIX).ids, chunks, tok.encode(question_text(item)).ids,
                    list(item.distractors), (), item)


def load_passages(path) -> list[RagItem]:
    """Items from a JSON file: [{"question": str, "passages": [str, ...], "answer": str (optional)}, ...].
    The passages are kept in order (in RagItem.distractors: no key passages are marked). ValueError
    with a one-line reason on anything else."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not JSON: {e}") from None
    if not isinstance(data, list) or not data:
        raise ValueError(f"{path}: expected a non-empty JSON list of items")
    items = []
    for n, it in enumerate(data):
        where = f"{path}: item {n}"
        if not isinstance(it, dict) or set(it) - {"question", "passages", "answer"}:
            raise ValueError(f"{where}: expected an object with keys question, passages, answer (optional)")
        q, ps, ans = it.get("question"), it.get("passages"), it.get("answer", "")
        if not isinstance(q, str) or not q.strip():
            raise ValueError(f"{where}: \"question\" must be a non-empty string")
        if not isinstance(ps, list) or len(ps) < 2 or not all(isinstance(x, str) and x.strip() for x in ps):
            raise ValueError(f"{where}: \"passages\" must be a list of at least 2 non-empty strings")
        if not isinstance(ans, str):
            raise ValueError(f"{where}: \"answer\" must be a string")
        items.append(RagItem(q.strip(), ans, (), tuple(ps)))
    return items


def rag_doc(rag: RagInput) -> RagDoc:
    ids = [bw.PREFIX] * len(rag.prefix) + [i for i, c in enumerate(rag.chunks) for _ in c]
    doc = rag.prefix + [t for c in rag.chunks for t in c]
    return RagDoc(torch.tensor([doc]), torch.tensor([rag.question]), torch.tensor(ids), rag)


# ------------------------------------------------------------------------------------ decoding
@torch.no_grad()
def greedy(model, logits: torch.Tensor, cache, n: int, stop: int | None = None) -> list[list[int]]:
    """Greedy continuations of B inputs at once, from their first answer token's logits (B, vocab) and
    their caches stacked on the batch axis (stack_caches): up to n tokens each, a row ending at `stop`.
    Decoding is bound by reading the weights, so B rows cost about as much as one."""
    out, done = [[] for _ in range(logits.shape[0])], [False] * logits.shape[0]
    for step in range(n):
        t = logits.argmax(-1)  # (B,)
        for b, tok in enumerate(t.tolist()):
            if not done[b]:
                out[b].append(tok)
                done[b] = tok == stop
        if all(done) or step == n - 1:
            break
        lg, cache = model(t[:, None], cache=cache, last=True)
        logits = lg[:, -1]
    return out


def stack_caches(caches: list[KVCache]) -> KVCache:
    """Caches of the same length (and positions) as one batch: every layer's K, V stacked on axis 0."""
    return KVCache([torch.cat(ks) for ks in zip(*(c.k for c in caches))],
                   [torch.cat(vs) for vs in zip(*(c.v for c in caches))], caches[0].pos)


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


def _key(r: float) -> str:
    return f"{r:g}"


@torch.no_grad()
def item_curve(model, rd: RagDoc, *, ratios, at: float, rules=RULE_NAMES, seed: int = SEED,
               answer_tokens: int = ANSWER_TOKENS, kl_tokens: int = KL_TOKENS, eos: int | None = None) -> dict:
    """Every rule at every ratio on one RAG input, sharing one full prefill and one precompute.
    Methods: full reuse; each rule of blend(); "random" (RANDOM_RULE's counts, tokens at random, seeded);
    "oracle" (oracle_cache: the true full-prefill K, V of the top r N tokens by true deviation, per layer).
    kl_first / kl_answer: {method: {ratio: KL}} (full reuse under the key "0"): KL(full || method) of the
    first answer token and its mean over the first kl_tokens, teacher-forced on full prefill's greedy
    answer. answers: greedy answers of full prefill, full reuse and every method at ratio `at`."""
    lg, full_cache = model(rd.tokens, last=True)
    first = lg[:, -1]
    pre = bw.precompute_chunks(model, rd.doc, rd.chunks)
    answer = greedy(model, first, full_cache, answer_tokens, eos)[0]
    ref = answer[:kl_tokens]
    lp_full = answer_logprobs(model, first, full_cache, ref)
    kl_first, kl_answer, to_decode = {}, {}, []

    def score(method, r, logits, cache):
        lp = answer_logprobs(model, logits, cache, ref)
        kl_first.setdefault(method, {})[_key(r)] = float(kl_divergence(lp_full[0], lp[0]))
        kl_answer.setdefault(method, {})[_key(r)] = float(kl_divergence(lp_full, lp).mean())
        if abs(r - at) < 1e-9 or method == "full reuse":
            to_decode.append((method, logits, cache))

    lg, c = model(rd.question, cache=pre, last=True)
    score("full reuse", 0.0, lg[:, -1], c)
    for r in ratios:
        for rule in rules:
            lg, tr = bw.blend(model, rd, rd.chunks, r, rule=blend_rules.RULES[rule], pre=pre, trace=True)
            score(rule, r, lg[:, -1], tr.cache)
        g = torch.Generator().manual_seed(seed)
        by_chance = blend_rules.Random(g, like=blend_rules.RULES[RANDOM_RULE])
        lg, tr = bw.blend(model, rd, rd.chunks, r, rule=by_chance, pre=pre, trace=True)
        score("random", r, lg[:, -1], tr.cache)
        lg, c = model(rd.question, cache=blend_rules.oracle_cache(pre, full_cache, r), last=True)
        score("oracle", r, lg[:, -1], c)
    # the greedy answers at ratio `at`, decoded together (one batch)
    rows = greedy(model, torch.cat([lg for _, lg, _ in to_decode]), stack_caches([c for *_, c in to_decode]),
                  answer_tokens, eos)
    answers = {"full prefill": answer, **{m: row for (m, _, _), row in zip(to_decode, rows)}}
    return {"kl_first": kl_first, "kl_answer": kl_answer, "answers": answers,
            "deviation": bw.kv_deviation(model, rd, rd.chunks, pre, full_cache)[:, 0],  # (L, N)
            "n_context": rd.doc.shape[1], "n_question": rd.question.shape[1],
            "chunk_lens": [b - a for a, b in bw.chunk_spans(rd.chunks)]}


@torch.no_grad()
def item_ttft(model, rd: RagDoc, ratio: float, rules=RULE_NAMES) -> dict:
    """Wall-clock TTFT of one input on one torch thread (on shared cores a second thread that waits for
    a core slows blend's many small steps far more than a prefill's large ones): full prefill, and per
    rule shift_kv of every layer's K (placing the stored chunks, timed apart because precompute_chunks
    already did it) + blend(), chunks' KV in memory. The chunks' precompute is not timed: it runs
    before, on the caller's threads."""
    pre = bw.precompute_chunks(model, rd.doc, rd.chunks)
    with single_thread():
        _, t_full = _timed(lambda: model(rd.tokens, last=True))
        _, t_shift = _timed(lambda: [shift_kv(k, 1000, model.cfg.rope_theta) for k in pre.k])
        out = {"full prefill": t_full}
        for name in rules:
            rule = blend_rules.RULES[name]
            out[name] = t_shift + _timed(lambda: bw.blend(model, rd, rd.chunks, ratio, rule=rule, pre=pre))[1]
    return out


def recompute_share(n_context: int, ratio: float, n_layers: int, rule: str) -> float:
    """Context-token layers recomputed by `rule` at `ratio`, as a share of a full prefill's (layer 0 in full)."""
    counts = blend_rules.RULES[rule].counts(n_context, ratio, n_layers)
    return (n_context + sum(counts)) / (n_layers * n_context)


# ------------------------------------------------------------------------------------ the experiment
def built_in_inputs(tok, n_items: int, chunk_tokens: int) -> list[RagInput]:
    return [rag_chunks(it, tok, chunk_tokens=chunk_tokens) for it in RAG_ITEMS[:n_items]]


def inputs_digest(rags: list[RagInput]) -> str:
    """A hash of the inputs' tokens: the cached curve is recomputed when any input changes."""
    h = hashlib.sha256()
    for r in rags:
        h.update(json.dumps([r.prefix, r.chunks, r.question]).encode())
    return h.hexdigest()[:16]


def real_experiment(model, tok, rags: list[RagInput], at: float, model_id: str, rule: str, curve: bool, ratios, *,
                    ttft_items: int, seed: int = SEED, recompute: bool = False, progress: bool = True) -> dict:
    """KL to full prefill on `rags` (cached: checkpoints.cached_result, keyed by the model file, the inputs'
    tokens, the rules, ratios and code) and the TTFT of every rule at ratio `at`, always measured
    live (item_ttft: one thread), median over the first `ttft_items` inputs.
    curve=False: `rule`, random and the oracle at `at` only (one blend per method and input);
    curve=True: every rule of RULE_NAMES, random and the oracle at each of `ratios` and `at`."""
    from tqdm import tqdm

    from common.checkpoints import cached_result

    eos = tok.token_to_id("<|im_end|>")
    ratios = tuple(sorted(set(ratios) | {at})) if curve else (at,)
    rules = RULE_NAMES if curve else (rule,)
    ident = {"model": model_id, "inputs": inputs_digest(rags), "ratios": ratios,
             "rules": rules, "random": RANDOM_RULE, "seed": seed, "at": at,
             "tokens": [ANSWER_TOKENS, KL_TOKENS]}

    def compute():
        items = []
        for rag in tqdm(rags, desc="SmolLM2 RAG items" + (" (curve)" if curve else ""), disable=not progress):
            r = item_curve(model, rag_doc(rag), ratios=ratios, at=at, rules=rules, seed=seed, eos=eos)
            r["text"] = {n: tok.decode(a) for n, a in r.pop("answers").items()}
            r["question"], r["reference"] = rag.item.question, rag.item.answer
            items.append(r)
        return {"items": items}

    computed = []  # compute() ran in this call (else the KL came from the cache)
    res = cached_result("blend-smollm2-curve" if curve else "blend-smollm2", ident,
                        lambda: computed.append(1) or compute(), refit=recompute, tag="04", flag="--recompute")
    items = res["items"]
    methods = ["full reuse", *rules, "random", "oracle"]
    mean = lambda key, m, r: statistics.fmean(it[key][m][r] for it in items)  # noqa: E731
    kl = {m: {_key(r): mean("kl_first", m, _key(r)) for r in ratios} for m in methods[1:]}
    kl_answer = {m: {_key(r): mean("kl_answer", m, _key(r)) for r in ratios} for m in methods[1:]}

    times = [item_ttft(model, rag_doc(rag), at) for rag in tqdm(rags[:ttft_items], desc="TTFT (live)",
                                                                   disable=not progress)]
    ttft = {m: statistics.median(t[m] for t in times) for m in times[0]}
    n_ctx = items[0]["n_context"]
    L = len(items[0]["deviation"])
    counts = {r: blend_rules.RULES[r].counts(n_ctx, at, L) for r in RULE_NAMES}
    same = {m: sum(it["text"][m] == it["text"]["full prefill"] for it in items) for m in ["full prefill", *methods]}
    return {"items": items, "ratios": ratios, "at": at, "rule": rule, "curve_mode": curve, "methods": methods,
            "curve": kl, "curve_answer": kl_answer,
            "kl_reuse": mean("kl_first", "full reuse", "0"), "kl_answer_reuse": mean("kl_answer", "full reuse", "0"),
            "ttft": ttft, "ttft_items": len(times), "threads": 1, "counts": counts,
            "share": {r: recompute_share(n_ctx, at, L, r) for r in RULE_NAMES},
            "same_answer": same, "kl_tokens": KL_TOKENS, "loaded_from_cache": not computed,
            "compute_seconds": res.get("compute_seconds"),
            "deviation": [torch.as_tensor(it["deviation"]) for it in items]}  # per item (L, N_i); cached as lists


def best_rule(res: dict) -> tuple[str, dict]:
    """The rule with the most quality per measured TTFT at ratio `at`, among the rules measured: the largest
    share of full reuse's first-token KL removed, (KL_reuse - KL_rule) / KL_reuse, per second of TTFT.
    Returns (name, scores)."""
    k = _key(res["at"])
    rules = [m for m in res["methods"] if m in blend_rules.RULES]
    scores = {rule: (1 - res["curve"][rule][k] / res["kl_reuse"]) / res["ttft"][rule] for rule in rules}
    return max(scores, key=scores.get), scores
