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

import hashlib
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # code/ holds `common`

import torch  # noqa: E402

import blend_world as bw  # noqa: E402
from common.english import CHAT_PREFIX, RAG_ITEMS, RagInput, RagItem, question_text, rag_chunks  # noqa: E402
from common.llama import kl_divergence, shift_kv, single_thread  # noqa: E402

ANSWER_TOKENS = 20    # greedy answer length
KL_TOKENS = 8         # answer tokens over which the KL is also averaged (teacher-forced)
SEED = 0
CURVE_RATIOS = (0.05, 0.15, 0.30, 0.50)   # the quality curve's recompute ratios (and the --ratio asked)
RULE_NAMES = tuple(bw.RULES)                          # blend()'s selection rules, all measured
RANDOM_RULE = "flat"  # the random baseline: r N tokens at every layer chosen at random (the oracle's budget)
CURVE_VERSION = "blend-curve-v1"  # the cached curve is keyed by this, the model file and the inputs


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


def _key(r: float) -> str:
    return f"{r:g}"


@torch.no_grad()
def item_curve(model, rd: RagDoc, ratios=CURVE_RATIOS, rules=RULE_NAMES, at: float = 0.15, seed: int = SEED,
               answer_tokens: int = ANSWER_TOKENS, kl_tokens: int = KL_TOKENS, eos: int | None = None) -> dict:
    """Every rule at every ratio on one RAG input, sharing one full prefill and one precompute.
    Methods: full reuse; each rule of blend(); "random" (RANDOM_RULE's counts, tokens at random, seeded);
    "oracle" (oracle_cache: the true full-prefill K, V of the top r N tokens by true deviation, per layer).
    kl_first / kl_answer: {method: {ratio: KL}} (full reuse under the key "0"): KL(full || method) of the
    first answer token and its mean over the first kl_tokens, teacher-forced on full prefill's greedy
    answer. answers: greedy answers of full prefill, full reuse and every method at ratio `at`."""
    lg, full_cache = model(rd.tokens)
    first = lg[:, -1]
    pre = bw.precompute_chunks(model, rd.doc, rd.chunks)
    answer = greedy(model, first, full_cache, answer_tokens, eos)
    ref = answer[:kl_tokens]
    lp_full = answer_logprobs(model, first, full_cache, ref)
    kl_first, kl_answer, answers = {}, {}, {"full prefill": answer}

    def score(method, r, logits, cache):
        lp = answer_logprobs(model, logits, cache, ref)
        kl_first.setdefault(method, {})[_key(r)] = float(kl_divergence(lp_full[0], lp[0]))
        kl_answer.setdefault(method, {})[_key(r)] = float(kl_divergence(lp_full, lp).mean())
        if abs(r - at) < 1e-9 or method == "full reuse":
            answers[method] = greedy(model, logits, cache, answer_tokens, eos)

    lg, c = model(rd.question, cache=pre)
    score("full reuse", 0.0, lg[:, -1], c)
    for r in ratios:
        for rule in rules:
            lg, tr = bw.blend(model, rd, rd.chunks, r, pre=pre, trace=True, rule=rule)
            score(rule, r, lg[:, -1], tr.cache)
        g = torch.Generator().manual_seed(seed)
        lg, tr = bw.blend(model, rd, rd.chunks, r, select="random", generator=g, pre=pre, trace=True,
                          rule=RANDOM_RULE)
        score("random", r, lg[:, -1], tr.cache)
        lg, c = model(rd.question, cache=bw.oracle_cache(pre, full_cache, r))
        score("oracle", r, lg[:, -1], c)
    return {"kl_first": kl_first, "kl_answer": kl_answer, "answers": answers,
            "deviation": bw.kv_deviation(model, rd, rd.chunks, pre, full_cache)[:, 0],  # (L, N)
            "n_context": rd.doc.shape[1], "n_question": rd.question.shape[1],
            "chunk_lens": [b - a for a, b in bw.chunk_spans(rd.chunks)]}


@torch.no_grad()
def item_ttft(model, rd: RagDoc, ratio: float, rules=RULE_NAMES) -> dict:
    """Wall-clock TTFT of one input on one torch thread (on shared cores a second thread that waits for
    a core slows blend's many small steps far more than a prefill's large ones): full prefill, and per
    rule shift_kv of every layer's K (placing the stored chunks, timed apart because precompute_chunks
    already did it) + blend(), chunks' KV in memory."""
    with single_thread():
        return _item_ttft(model, rd, ratio, rules)


def _item_ttft(model, rd: RagDoc, ratio: float, rules) -> dict:
    _, t_full = _timed(lambda: model(rd.tokens))
    pre = bw.precompute_chunks(model, rd.doc, rd.chunks)
    _, t_shift = _timed(lambda: [shift_kv(k, 1000, model.cfg.rope_theta) for k in pre.k])
    out = {"full prefill": t_full}
    for rule in rules:
        out[rule] = t_shift + _timed(lambda: bw.blend(model, rd, rd.chunks, ratio, pre=pre, rule=rule))[1]
    return out


def recompute_share(n_context: int, ratio: float, n_layers: int, rule: str) -> float:
    """Context-token layers recomputed by `rule` at `ratio`, as a share of a full prefill's (layer 0 in full)."""
    r = bw.RULES[rule]
    return (n_context + sum(bw.blend_counts(n_context, ratio, n_layers, r.schedule, r.check))) / (n_layers * n_context)


# ------------------------------------------------------------------------------------ the experiment
def built_in_inputs(tok, n_items: int) -> list[RagInput]:
    return [rag_chunks(it, tok) for it in RAG_ITEMS[:n_items]]


def inputs_digest(rags: list[RagInput]) -> str:
    """A hash of the inputs' tokens: the cached curve is recomputed when any input changes."""
    h = hashlib.sha256()
    for r in rags:
        h.update(json.dumps([r.prefix, r.chunks, r.question]).encode())
    return h.hexdigest()[:16]


def real_experiment(model, tok, rags: list[RagInput], at: float, model_id: str, ratios=CURVE_RATIOS,
                    seed: int = SEED, ttft_items: int = 2, recompute: bool = False, progress: bool = True) -> dict:
    """The quality curve of every rule on `rags` (cached: checkpoints.cached_result, keyed by the model file,
    the inputs' tokens, ratios, rules and CURVE_VERSION) and the TTFT of every rule at ratio `at`, always
    measured live (item_ttft: one thread), median over the first `ttft_items` inputs."""
    from tqdm import tqdm

    from common.checkpoints import cached_result

    eos = tok.token_to_id("<|im_end|>")
    ratios = tuple(sorted(set(ratios) | {at}))
    ident = {"version": CURVE_VERSION, "model": model_id, "inputs": inputs_digest(rags), "ratios": ratios,
             "rules": RULE_NAMES, "random": RANDOM_RULE, "seed": seed, "at": at,
             "tokens": [ANSWER_TOKENS, KL_TOKENS]}

    def compute():
        items = []
        for rag in tqdm(rags, desc="SmolLM2 RAG items (curve)", disable=not progress):
            r = item_curve(model, rag_doc(rag), ratios, RULE_NAMES, at, seed, eos=eos)
            r["text"] = {n: tok.decode(a) for n, a in r.pop("answers").items()}
            r["question"], r["reference"] = rag.item.question, rag.item.answer
            items.append(r)
        return {"items": items}

    computed = []  # compute() ran in this call (else the curve came from the cache)
    res = cached_result("blend-smollm2-curve", ident, lambda: computed.append(1) or compute(),
                        refit=recompute, tag="04", flag="--recompute")
    items = res["items"]
    methods = ["full reuse", *RULE_NAMES, "random", "oracle"]
    mean = lambda key, m, r: statistics.fmean(it[key][m][r] for it in items)  # noqa: E731
    curve = {m: {_key(r): mean("kl_first", m, _key(r)) for r in ratios} for m in methods[1:]}
    curve_answer = {m: {_key(r): mean("kl_answer", m, _key(r)) for r in ratios} for m in methods[1:]}
    reuse = mean("kl_first", "full reuse", "0")
    reuse_answer = mean("kl_answer", "full reuse", "0")

    times = [item_ttft(model, rag_doc(rag), at) for rag in tqdm(rags[:ttft_items], desc="TTFT (live)",
                                                                   disable=not progress)]
    ttft = {m: statistics.median(t[m] for t in times) for m in times[0]}
    n_ctx = items[0]["n_context"]
    L = len(items[0]["deviation"])
    counts = {rule: bw.blend_counts(n_ctx, at, L, bw.RULES[rule].schedule, bw.RULES[rule].check) for rule in RULE_NAMES}
    names = ["full prefill", "full reuse"] + [m for m in methods[1:] if m != "oracle"]
    same = {m: sum(it["text"][m] == it["text"]["full prefill"] for it in items) for m in names if m in items[0]["text"]}
    return {"items": items, "ratios": ratios, "at": at, "methods": methods, "curve": curve,
            "curve_answer": curve_answer, "kl_reuse": reuse, "kl_answer_reuse": reuse_answer,
            "ttft": ttft, "ttft_items": len(times), "threads": 1, "counts": counts,
            "share": {rule: recompute_share(n_ctx, at, L, rule) for rule in RULE_NAMES},
            "same_answer": same, "kl_tokens": KL_TOKENS, "loaded_from_cache": not computed,
            "compute_seconds": res.get("compute_seconds"),
            "deviation": [torch.as_tensor(it["deviation"]) for it in items]}  # per item (L, N_i); cached as lists


def best_rule(res: dict) -> tuple[str, dict]:
    """The rule with the most quality per measured TTFT at ratio `at`: the largest share of full reuse's
    first-token KL removed, (KL_reuse - KL_rule) / KL_reuse, per second of TTFT. Returns (name, scores)."""
    k = _key(res["at"])
    scores = {rule: (1 - res["curve"][rule][k] / res["kl_reuse"]) / res["ttft"][rule] for rule in RULE_NAMES}
    return max(scores, key=scores.get), scores
