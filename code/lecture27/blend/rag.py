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
  ranking-oracle r  the rule's counts and nesting, the tokens picked by their true deviation, then
                 recomputed by blend() (blend_rules.RankingOracle): the ceiling of the rule's ranking
  oracle r       the full prefill's own K, V for the r N most deviated tokens of every layer (the patch
                 oracle, a ceiling of any recompute)
The rule's distance to the ranking oracle is what its ranking loses, the ranking oracle's distance to the
patch oracle what recomputing from a partly stale cache loses (decompose: a Decomposition per input set).

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
import shutil
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from lecture27 import blend_rules
from lecture27 import blend_world as bw
from lecture27 import kvstore as ks
from common.english import CHAT_PREFIX, RAG_ITEMS, RagInput, RagItem, question_text, rag_chunks
from common.clock import timed
from common.llama import KVCache, greedy, kl_divergence, single_thread

ANSWER_TOKENS = 20    # greedy answer length
KL_TOKENS = 8         # answer tokens over which the KL is also averaged (teacher-forced)
SEED = 0
RANDOM_RULE = "flat"  # the random baseline: r N tokens at every layer chosen at random (the oracle's budget)


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


def check_context(model, rags: list[RagInput]) -> None:
    """Before any work: every input, with the ANSWER_TOKENS decoded after it, within the model's context
    (model.context_length: the GGUF's llama.context_length; a model without one is not checked). Else one line
    on stderr naming the first input that is longer, its token count and the limit, and exit code 2."""
    from common.cli import fail
    from common.present import plural

    limit = getattr(model, "context_length", None)
    for n, rag in enumerate(rags if limit else []):
        tokens = len(rag.prefix) + sum(map(len, rag.chunks)) + len(rag.question)
        if tokens + ANSWER_TOKENS > limit:
            parts = f"prefix, {plural(len(rag.chunks), 'chunk')}, question"
            fail(f"RAG item {n} ({rag.item.question[:40]!r}) is {tokens:,} tokens ({parts}) and {ANSWER_TOKENS} answer "
                 f"tokens: more than the model's context of {limit:,} tokens (llama.context_length)")


# ------------------------------------------------------------------------------------ decoding
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
def _key(r: float) -> str:
    return f"{r:g}"


def ranking_name(rule: str, ranked: tuple) -> str:
    """The method name of `rule`'s ranking oracle: "ranking-oracle" for the run's rule (ranked[0]),
    "ranking-oracle <rule>" for the others measured beside it."""
    return "ranking-oracle" if rule == ranked[0] else f"ranking-oracle {rule}"


@torch.no_grad()
def prefilled(model, rd: bw.RagDoc, answer_tokens: int, eos: int | None, shared: dict | None = None) -> tuple:
    """What every method on one input is measured against: full prefill's last logits and its cache, full
    reuse's cache (each chunk precomputed alone, then placed) and full prefill's greedy answer. `shared`: one
    run's dict of them by input, so that kl_curves and input_rule_curves, which measure the same inputs,
    compute them once."""
    key = hashlib.sha256(b"".join(t.numpy().tobytes() for t in (rd.doc, rd.question, rd.chunks))).hexdigest()
    if shared is not None and (key, answer_tokens) in shared:
        return shared[key, answer_tokens]
    lg, full_cache = model(rd.tokens, last=True)
    first = lg[:, -1]
    out = first, full_cache, bw.precompute_chunks(model, rd.doc, rd.chunks), greedy(model, first, full_cache,
                                                                                     answer_tokens, eos)[0]
    if shared is not None:
        shared[key, answer_tokens] = out
    return out


def item_curve(model, rd: bw.RagDoc, *, ratios, ratio: float, rules=blend_rules.RULE_NAMES, ranked=(),
               seed: int = SEED, answer_tokens: int = ANSWER_TOKENS, kl_tokens: int = KL_TOKENS,
               eos: int | None = None, shared: dict | None = None) -> dict:
    """Every rule at every ratio on one RAG input, sharing one full prefill and one precompute.
    Methods: full reuse; each rule of blend(); "random" (RANDOM_RULE's counts, tokens at random, seeded);
    the ranking oracle of each rule in `ranked` (ranking_name; the run's rule first); "oracle"
    (oracle_cache: the true full-prefill K, V of the top r N tokens by true deviation, per layer).
    kl_first / kl_answer: {method: {ratio: KL}} (full reuse under the key "0"): KL(full || method) of the
    first answer token and its mean over the first kl_tokens, teacher-forced on full prefill's greedy
    answer. answers: greedy answers of full prefill, full reuse and every method at the run's `ratio` (of the
    ranking oracles only the run's rule's). shared: see prefilled."""
    first, full_cache, pre, answer = prefilled(model, rd, answer_tokens, eos, shared)
    deviation = bw.kv_deviation(model, rd, rd.chunks, pre, full_cache)  # (L, 1, N)
    ref = answer[:kl_tokens]
    lp_full = answer_logprobs(model, first, full_cache, ref)
    kl_first, kl_answer, to_decode = {}, {}, []

    def score(method, r, logits, cache):
        lp = answer_logprobs(model, logits, cache, ref)
        kl_first.setdefault(method, {})[_key(r)] = float(kl_divergence(lp_full[0], lp[0]))
        kl_answer.setdefault(method, {})[_key(r)] = float(kl_divergence(lp_full, lp).mean())
        if (abs(r - ratio) < 1e-9 and not method.startswith("ranking-oracle ")) or method == "full reuse":
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
        for rule in ranked:
            best = blend_rules.RankingOracle(blend_rules.RULES[rule], deviation)
            lg, tr = bw.blend(model, rd, rd.chunks, r, rule=best, pre=pre, trace=True)
            score(ranking_name(rule, ranked), r, lg[:, -1], tr.cache)
        lg, c = model(rd.question, cache=blend_rules.oracle_cache(pre, full_cache, r), last=True)
        score("oracle", r, lg[:, -1], c)
    # the greedy answers at the run's ratio, decoded together (one batch)
    rows = greedy(model, torch.cat([lg for _, lg, _ in to_decode]), stack_caches([c for *_, c in to_decode]),
                  answer_tokens, eos)
    answers = {"full prefill": answer, **{m: row for (m, _, _), row in zip(to_decode, rows)}}
    return {"kl_first": kl_first, "kl_answer": kl_answer, "answers": answers,
            "deviation": deviation[:, 0],  # (L, N)
            "n_context": rd.doc.shape[1], "n_question": rd.question.shape[1],
            "chunk_lens": [b - a for a, b in bw.chunk_spans(rd.chunks)]}


STORE_TIERS = ("ram", "disk")   # where item_ttft's chunks are fetched from: kvstore's RamTier and DiskTier
STORE_BUDGET = 1 << 30          # the tier's byte budget (room for any input's chunks)


@torch.no_grad()
def chunk_store(model, rd: bw.RagDoc, tier: str, folder: Path, model_id: str) -> tuple:
    """The input's chunks (the shared prefix as one more), each prefilled alone behind the prefix
    (kvstore.chunk_kvs), stored as FP16 records in a real kvstore tier under their content's keys, as LMCache
    keys them (kvstore.chunk_keys: the model `model_id`, the prefix, the chunk's tokens). -> (store, keys)."""
    ids = bw.chunk_ids(rd.doc.shape[1], rd.chunks)
    n_pre, doc = int((ids == bw.PREFIX).sum()), rd.doc[0].tolist()
    prefix, chunks = doc[:n_pre], [doc[a:b] for a, b in bw.chunk_spans(ids)]
    t = ks.RamTier(STORE_BUDGET) if tier == "ram" else ks.DiskTier(folder, STORE_BUDGET)
    store = ks.ChunkStore(t, "fp16", shape=ks.kv_shape(model.cfg))
    keys = ks.chunk_keys(model_id, prefix, chunks)
    for key, X in zip(keys, ks.chunk_kvs(model, prefix, chunks)):
        store.put(key, X)
    return store, keys


def fetch_chunks(store, keys) -> list:
    """Every chunk's record read from its tier (a disk record's pages dropped from the page cache first, so
    the disk is read), checked and widened to float32: each chunk's KV as it was prefilled, before
    kvstore.assemble places it."""
    for k in keys:
        store.tier.drop_cache(store.name(k))
    return store.get_many(keys)


@torch.no_grad()
def item_ttft(model, rd: bw.RagDoc, ratio: float, rules=blend_rules.RULE_NAMES, tier: str = "ram", *,
              model_id: str) -> dict:
    """Wall-clock TTFT of one input on one torch thread (on shared cores a second thread that waits for
    a core slows blend's many small steps far more than a prefill's large ones): full prefill, and per
    rule the chunks' KV fetched from a real store's tier (`tier`, one of STORE_TIERS: chunk_store,
    fetch_chunks) + placing them (kvstore.assemble: shift_kv of each chunk's K to its place) + the rule's
    own work on the input (its ready(): a query rule's pass of the question over full reuse's cache) +
    blend(). rules: names of blend_rules.ALL_RULES, or {name: rule}. model_id: the model as the chunks'
    keys name it (kvstore.model_id). The chunks' prefill and storing are not timed: they run before, on the
    caller's threads. The fetch's seconds (the records read, checked and widened, before placing) and bytes
    come back under "fetch" and "fetch bytes"."""
    from common.checkpoints import checkpoint_dir
    rules = rules if isinstance(rules, dict) else {name: blend_rules.ALL_RULES[name] for name in rules}
    folder = Path(tempfile.mkdtemp(prefix="kvstore-", dir=checkpoint_dir()))
    try:
        store, keys = chunk_store(model, rd, tier, folder, model_id)
        nbytes = store.tier.used
        out = {}
        with single_thread():
            _, t_full = timed(lambda: model(rd.tokens, last=True))
            out["full prefill"] = t_full
            fetches = []
            for name, rule in rules.items():
                arrays, t_fetch = timed(lambda: fetch_chunks(store, keys))
                got, t_place = timed(lambda: ks.assemble(keys, arrays, model.cfg))
                fetches.append(t_fetch)
                out[name] = t_fetch + t_place + timed(lambda: bw.blend(
                    model, rd, rd.chunks, ratio, rule=rule.ready(model, rd, rd.chunks, got), pre=got))[1]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return {**out, "fetch": statistics.median(fetches), "fetch bytes": nbytes}


# ------------------------------------------------------------------------------------ rules that read the input
def alone_doc(rd: bw.RagDoc) -> bw.RagDoc:
    """The same input with no shared prefix: the chat prefix belongs to the first chunk and every chunk is
    prefilled alone at position 0 (carrying an attention sink of its own), as EPIC stores chunks."""
    ids = torch.where(rd.chunks == bw.PREFIX, torch.zeros_like(rd.chunks), rd.chunks)
    return bw.RagDoc(rd.doc, rd.question, ids, rd.rag)


@torch.no_grad()
def item_input_rules(model, rd: bw.RagDoc, *, ratios, rules, ratio: float, depths=(), reuse: bool = False,
                     kl_tokens: int = KL_TOKENS, eos: int | None = None, shared: dict | None = None) -> dict:
    """Rules of blend_rules.ALL_RULES (each after its own work on the input, its ready()) at every
    ratio on one RAG input, sharing one full prefill and one precompute of rd.chunks; with `depths`, each
    query rule (blend_rules.QUERY_RULES) also at the run's `ratio` reading layers 1..j for j in depths
    (blend_rules.depth_name); with
    `reuse`, full reuse (key "0") and the patch oracle too. kl_first / kl_answer as item_curve's:
    first answer token and the mean over the first kl_tokens of full prefill's greedy answer,
    teacher-forced (the first kl_tokens of full prefill's greedy answer of ANSWER_TOKENS: a greedy answer's
    first tokens do not depend on its length). shared: see prefilled."""
    first, full_cache, pre, answer = prefilled(model, rd, ANSWER_TOKENS, eos, shared)
    ref = answer[:kl_tokens]
    lp_full = answer_logprobs(model, first, full_cache, ref)
    kl_first, kl_answer = {}, {}

    def score(method, r, logits, cache):
        lp = answer_logprobs(model, logits, cache, ref)
        kl_first.setdefault(method, {})[_key(r)] = float(kl_divergence(lp_full[0], lp[0]))
        kl_answer.setdefault(method, {})[_key(r)] = float(kl_divergence(lp_full, lp).mean())

    def run(method, rule, r):
        lg, tr = bw.blend(model, rd, rd.chunks, r, rule=rule.ready(model, rd, rd.chunks, pre), pre=pre, trace=True)
        score(method, r, lg[:, -1], tr.cache)

    if reuse:
        lg, c = model(rd.question, cache=pre, last=True)
        score("full reuse", 0.0, lg[:, -1], c)
    for r in ratios:
        for name in rules:
            run(name, blend_rules.ALL_RULES[name], r)
        if reuse:
            lg, c = model(rd.question, cache=blend_rules.oracle_cache(pre, full_cache, r), last=True)
            score("oracle", r, lg[:, -1], c)
    L = model.cfg.n_layers
    for name in blend_rules.QUERY_RULES if depths else ():
        for j in depths:
            deep, method = blend_rules.at_depth(name, j), blend_rules.depth_name(name, j)
            if name in rules and ratio in ratios and deep.depth(L) == blend_rules.ALL_RULES[name].depth(L):
                kl_first[method] = {_key(ratio): kl_first[name][_key(ratio)]}  # the rule itself: every layer
                kl_answer[method] = {_key(ratio): kl_answer[name][_key(ratio)]}
            else:
                run(method, deep, ratio)
    return {"kl_first": kl_first, "kl_answer": kl_answer, "n_context": rd.doc.shape[1],
            "n_question": rd.question.shape[1]}


def input_rule_curves(model, tok, rags: list[RagInput], *, ratios, ratio: float, rules, model_id: str, depths=(),
                      alone: bool = False, recompute: bool = False, progress: bool = True,
                      shared: dict | None = None) -> dict:
    """item_input_rules on every input (alone: the inputs with no shared prefix, alone_doc, with full
    reuse and the patch oracle), cached (checkpoints.cached_result "blend-smollm2-input-rules", keyed by
    the model file, the inputs' tokens, the rules, ratios, depths and the code). Returns {"items": [...],
    "kl": {method: {ratio: mean KL}}, "kl_answer": ..., "loaded_from_cache", "compute_seconds"}."""
    from tqdm import tqdm

    from common.checkpoints import cached_result

    eos = tok.token_to_id("<|im_end|>")
    ident = {"model": model_id, "inputs": inputs_digest(rags), "ratios": list(ratios), "rules": list(rules),
             "depths": list(depths), "ratio": ratio, "alone": alone, "tokens": KL_TOKENS}

    def compute():
        items = []
        for rag in tqdm(rags, desc=f"SmolLM2 RAG items ({len(rules)} input rules{', alone' if alone else ''})",
                        disable=not progress):
            rd = alone_doc(bw.rag_doc(rag)) if alone else bw.rag_doc(rag)
            items.append(item_input_rules(model, rd, ratios=ratios, rules=rules, ratio=ratio, depths=depths,
                                          reuse=alone, eos=eos, shared=shared))
        return {"items": items}

    computed = []
    res = cached_result("blend-smollm2-input-rules", ident, lambda: computed.append(1) or compute(), refit=recompute,
                        tag="04", flag="--recompute")
    items = res["items"]
    mean = {key: {m: {k: statistics.fmean(it[key][m][k] for it in items) for k in items[0][key][m]}
                  for m in items[0][key]} for key in ("kl_first", "kl_answer")}
    return {"items": items, "kl": mean["kl_first"], "kl_answer": mean["kl_answer"],
            "loaded_from_cache": not computed, "compute_seconds": res.get("compute_seconds")}


# ------------------------------------------------------------------------------------ the experiment
def built_in_inputs(tok, n_items: int, chunk_tokens: int) -> list[RagInput]:
    return [rag_chunks(it, tok, chunk_tokens=chunk_tokens) for it in RAG_ITEMS[:n_items]]


def inputs_digest(rags: list[RagInput]) -> str:
    """A hash of the inputs' tokens: the cached curve is recomputed when any input changes."""
    h = hashlib.sha256()
    for r in rags:
        h.update(json.dumps([r.prefix, r.chunks, r.question]).encode())
    return h.hexdigest()[:16]


@dataclass(frozen=True, kw_only=True)
class Answered:
    """One input as measured (item_curve) and answered: its question, the reference answer, each method's
    greedy answer, its lengths, its KL to full prefill {method: {ratio: KL}} (first answer token and the
    mean over the first KL_TOKENS) and full reuse's KV deviation (L, N)."""
    question: str
    reference: str
    text: dict                      # method -> greedy answer
    n_context: int
    n_question: int
    chunk_lens: list
    kl_first: dict
    kl_answer: dict
    deviation: torch.Tensor

    @classmethod
    def from_plain(cls, d: dict) -> Answered:
        """The input from its cached plain data (cached_result stores the deviation as nested lists)."""
        return cls(**{**d, "deviation": torch.as_tensor(d["deviation"])})


@dataclass(kw_only=True)
class Curves:
    """Mean over the inputs of KL(full prefill || method), first answer token (`kl`) and over the first
    KL_TOKENS answer tokens (`kl_answer`), {method: {ratio: KL}}; full reuse apart (`reuse`,
    `reuse_answer`). methods: full reuse, the rules, random, the ranking oracle of the run's rule, the
    patch oracle; ranking: the ranking oracle of every rule measured, {rule: {ratio: KL}}. items: each
    input's measurement (Answered)."""
    ratios: tuple
    methods: list
    kl: dict
    kl_answer: dict
    reuse: float
    reuse_answer: float
    ranking: dict
    items: list
    loaded_from_cache: bool
    compute_seconds: float


def kl_curves(model, tok, rags: list[RagInput], *, ratios, ratio: float, rules, ranked, model_id: str,
              seed: int = SEED, recompute: bool = False, progress: bool = True, name: str = "blend-smollm2",
              shared: dict | None = None) -> Curves:
    """item_curve on every input, cached (checkpoints.cached_result `name`, keyed by the model file, the
    inputs' tokens, the rules, the ranked rules (ranked[0]: the run's rule), ratios and the code); each input
    rebuilt from the cached plain data (Answered.from_plain)."""
    from tqdm import tqdm

    from common.checkpoints import cached_result

    eos = tok.token_to_id("<|im_end|>")
    ident = {"model": model_id, "inputs": inputs_digest(rags), "ratios": ratios,
             "rules": rules, "ranked": ranked, "random": RANDOM_RULE, "seed": seed, "ratio": ratio,
             "tokens": [ANSWER_TOKENS, KL_TOKENS]}

    def compute():
        items = []
        desc = f"SmolLM2 RAG items ({len(rules)} rules, {len(ratios)} ratios)"
        for rag in tqdm(rags, desc=desc, disable=not progress):
            r = item_curve(model, bw.rag_doc(rag), ratios=ratios, ratio=ratio, rules=rules, ranked=ranked, seed=seed,
                           eos=eos, shared=shared)
            r["text"] = {n: tok.decode(a) for n, a in r.pop("answers").items()}
            r["question"], r["reference"] = rag.item.question, rag.item.answer
            items.append(r)
        return {"items": items}

    computed = []  # compute() ran in this call (else the KL came from the cache)
    res = cached_result(name, ident, lambda: computed.append(1) or compute(), refit=recompute, tag="04",
                        flag="--recompute")
    items = [Answered.from_plain(it) for it in res["items"]]
    mean = lambda key, m, r: statistics.fmean(getattr(it, key)[m][_key(r)] for it in items)  # noqa: E731
    measured = [*rules, "random", *(ranking_name(r, ranked) for r in ranked), "oracle"]
    kl = {m: {r: mean("kl_first", m, r) for r in ratios} for m in measured}
    return Curves(ratios=tuple(ratios), methods=["full reuse", *rules, "random", "ranking-oracle", "oracle"],
                  kl=kl, kl_answer={m: {r: mean("kl_answer", m, r) for r in ratios} for m in measured},
                  reuse=mean("kl_first", "full reuse", 0), reuse_answer=mean("kl_answer", "full reuse", 0),
                  ranking={r: kl[ranking_name(r, ranked)] for r in ranked}, items=items,
                  loaded_from_cache=not computed, compute_seconds=res.get("compute_seconds"))


@dataclass(kw_only=True)
class Experiment:
    """real_experiment's result. Dicts keyed by method name; the KL curves {method: {ratio: KL}} with the
    ratio written as "0.15"."""
    items: list                     # Answered, one per input
    ratios: tuple
    ratio: float                    # the run's ratio
    rule: str                       # the rule reported as CacheBlend
    curve_mode: bool                # every rule measured at every ratio
    methods: list
    curve: dict                     # first answer token's KL
    curve_answer: dict              # mean over the first kl_tokens answer tokens
    kl_reuse: float
    kl_answer_reuse: float
    ranking: dict                   # rule -> its ranking oracle's curve (an input rule: flat's)
    ttft: dict                      # method -> seconds
    ttft_items: int
    ttft_when: dict                 # when and where the TTFT was measured (measured.cached_measurement's info)
    ttft_tier: str                  # the store tier the timed runs fetched the chunks from
    ttft_fetch_s: float             # ... and the fetch's seconds (median over the rules' runs)
    ttft_fetch_bytes: int           # ... of that many bytes of FP16 records
    threads: int
    counts: dict                    # rule -> tokens recomputed at layers 1..
    share: dict                     # rule -> recomputed share of a full prefill's context-token layers
    same_answer: dict               # method -> inputs whose greedy answer is full prefill's
    kl_tokens: int
    loaded_from_cache: bool
    compute_seconds: float | None
    curves: Curves
    query: dict                     # each query rule at `ratio` over j: {"depths", "kl", "ttft", "share": {rule: []}}
    no_prefix: dict | None          # --curve: {method: KL at `ratio`} with every chunk prefilled alone at position 0
    best: str                       # the rule with the most quality per measured TTFT (of those measured)
    score: dict                     # rule -> its quality per TTFT (best_rule)

    @property
    def deviation(self) -> list:
        """Per input (L, N) of full reuse's KV deviation."""
        return [it.deviation for it in self.items]


def real_experiment(model, tok, rags: list[RagInput], ratio: float, model_id: str, rule: str, curve: bool, ratios, *,
                    ttft_items: int, tier: str, depths=(), alone: bool = False, seed: int = SEED,
                    recompute: bool = False, remeasure: bool = False, progress: bool = True) -> Experiment:
    """KL to full prefill on `rags` (kl_curves and input_rule_curves, cached) and the TTFT of every rule at
    `ratio` (item_ttft: one thread, the chunks fetched from `tier`), median over the first `ttft_items` inputs,
    measured once on this machine and cached (measured.cached_measurement; remeasure: again).
    curve=False: `rule` (or flat, when it is an input rule), the input rules (blend_rules.INPUT_RULE_NAMES), random,
    the ranking oracle and the patch oracle at `ratio` only (one blend per method and input); curve=True:
    every rule of ALL_RULE_NAMES, random, every rule's ranking oracle and the patch oracle at each of
    `ratios` and `ratio`, and each query rule at `ratio` reading layers 1..j for j in `depths` (KL and TTFT);
    alone (with curve): flat and the input rules at `ratio` on the inputs with no shared prefix (alone_doc).
    An input rule keeps flat's counts: its ranking oracle is flat's."""
    from tqdm import tqdm

    from common.measured import cached_measurement

    check_context(model, rags)
    ratios = tuple(sorted(set(ratios) | {ratio})) if curve else (ratio,)
    base = blend_rules.blend_rule_of(rule)
    rules = blend_rules.RULE_NAMES if curve else (base,)
    ranked = (base, *(r for r in rules if r != base))
    shared = {}   # each input's full prefill, precompute and greedy answer, for both studies (prefilled)
    c = kl_curves(model, tok, rags, ratios=ratios, ratio=ratio, rules=rules, ranked=ranked, model_id=model_id,
                  seed=seed, recompute=recompute, progress=progress,
                  name="blend-smollm2-curve" if curve else "blend-smollm2", shared=shared)
    depths = tuple(depths) if curve else ()
    q = input_rule_curves(model, tok, rags, ratios=ratios, ratio=ratio, rules=blend_rules.INPUT_RULE_NAMES,
                          model_id=model_id, depths=depths, recompute=recompute, progress=progress, shared=shared)
    shared.clear()
    c.kl.update({m: {float(k): v for k, v in kl.items()} for m, kl in q["kl"].items()})
    c.kl_answer.update({m: {float(k): v for k, v in kl.items()} for m, kl in q["kl_answer"].items()})
    c.ranking.update({m: c.ranking[blend_rules.blend_rule_of(m)] for m in blend_rules.INPUT_RULE_NAMES
                      if blend_rules.blend_rule_of(m) in c.ranking})
    measured = (*rules, *blend_rules.INPUT_RULE_NAMES)
    c.methods = ["full reuse", *measured, "random", "ranking-oracle", "oracle"]
    items, methods = c.items, c.methods
    by_key = lambda d: {_key(r): v for r, v in d.items()}  # noqa: E731
    to_time = {**{m: blend_rules.ALL_RULES[m] for m in blend_rules.ALL_RULE_NAMES},
               **{blend_rules.depth_name(m, j): blend_rules.at_depth(m, j)
                  for m in blend_rules.QUERY_RULES for j in depths}}
    timed = rags[:ttft_items]
    times, when = cached_measurement(
        "blend-smollm2-ttft", {"model": model_id, "inputs": inputs_digest(timed), "ratio": ratio, "tier": tier,
                               "methods": list(to_time)},
        lambda: [item_ttft(model, bw.rag_doc(rag), ratio, to_time, tier, model_id=model_id)
                 for rag in tqdm(timed, desc="TTFT (measured on this machine)", disable=not progress)],
        remeasure, tag="04")
    fetch_s, fetch_bytes = statistics.median(t.pop("fetch") for t in times), times[0].pop("fetch bytes")
    ttft = {m: statistics.median(t[m] for t in times) for m in times[0]}
    n_ctx, n_q = items[0].n_context, items[0].n_question
    L = len(items[0].deviation)
    counts = {r: blend_rules.ALL_RULES[r].counts(n_ctx, ratio, L) for r in blend_rules.ALL_RULE_NAMES}
    same = {m: sum(it.text[m] == it.text["full prefill"] for it in items)
            for m in ["full prefill", *methods] if m in items[0].text}
    k = _key(ratio)
    query = {"depths": list(depths),
             "kl": {m: [q["kl"][blend_rules.depth_name(m, j)][k] for j in depths] for m in blend_rules.QUERY_RULES},
             "ttft": {m: [ttft[blend_rules.depth_name(m, j)] for j in depths] for m in blend_rules.QUERY_RULES},
             "share": {m: [blend_rules.work_share(n_ctx, n_q, ratio, L, blend_rules.at_depth(m, j)) for j in depths]
                       for m in blend_rules.QUERY_RULES}}
    no_prefix = None
    if curve and alone:
        a = input_rule_curves(model, tok, rags, ratios=(ratio,), ratio=ratio,
                              rules=("flat", *blend_rules.INPUT_RULE_NAMES), model_id=model_id, alone=True,
                              recompute=recompute, progress=progress)
        no_prefix = {m: kl[k] if m != "full reuse" else kl["0"] for m, kl in a["kl"].items()}
    first = {m: by_key(c.kl[m]) for m in methods[1:]}
    best, score = best_rule(methods=methods, curve=first, kl_reuse=c.reuse, ttft=ttft, ratio=ratio)
    return Experiment(items=items, ratios=ratios, ratio=ratio, rule=rule, curve_mode=curve, methods=methods,
                      curve=first, curve_answer={m: by_key(c.kl_answer[m]) for m in methods[1:]},
                      kl_reuse=c.reuse, kl_answer_reuse=c.reuse_answer,
                      ranking={r: by_key(v) for r, v in c.ranking.items()},
                      ttft=ttft, ttft_items=len(times), ttft_when=when, ttft_tier=tier, ttft_fetch_s=fetch_s,
                      ttft_fetch_bytes=fetch_bytes, threads=1, counts=counts,
                      share={r: blend_rules.work_share(n_ctx, n_q, ratio, L, r) for r in blend_rules.ALL_RULE_NAMES},
                      same_answer=same, kl_tokens=KL_TOKENS,
                      loaded_from_cache=c.loaded_from_cache and q["loaded_from_cache"],
                      compute_seconds=(c.compute_seconds or 0) + (q["compute_seconds"] or 0), curves=c,
                      query=query, no_prefix=no_prefix, best=best, score=score)


def best_rule(*, methods, curve: dict, kl_reuse: float, ttft: dict, ratio: float) -> tuple[str, dict]:
    """The rule with the most quality per measured TTFT at `ratio`, among the rules measured (`methods`):
    the largest share of full reuse's first-token KL removed, (KL_reuse - KL_rule) / KL_reuse, per second of
    TTFT. Returns (name, scores)."""
    k = _key(ratio)
    rules = [m for m in methods if m in blend_rules.ALL_RULES]
    scores = {rule: (1 - curve[rule][k] / kl_reuse) / ttft[rule] for rule in rules}
    return max(scores, key=scores.get), scores


# ------------------------------------------------------------------------------------ where the error comes from
@dataclass(frozen=True, kw_only=True)
class Decomposition:
    """A rule's mean first-token KL to full prefill split in two at each recompute ratio (numbers as keys):
    rule -> ranking oracle (its counts, the true ranking) is what its ranking loses; ranking oracle ->
    patch oracle (the full prefill's own K, V for as many tokens) is what recomputing from a partly stale
    cache loses. `reuse`: full reuse's KL, where every curve starts."""
    source: str
    rule: str
    n_inputs: int
    reuse: float
    rule_kl: dict
    ranking: dict
    patch: dict

    @property
    def ratios(self) -> tuple:
        return tuple(self.rule_kl)

    def ranking_part(self, r: float) -> float:
        return self.rule_kl[r] - self.ranking[r]

    def recompute_part(self, r: float) -> float:
        return self.ranking[r] - self.patch[r]

    def dominant(self, r: float) -> str:
        """"ranking" or "recompute": the larger part of the rule's distance to the patch oracle at r;
        "none" when the rule is at or past the patch oracle (no distance to split)."""
        if self.rule_kl[r] <= self.patch[r]:
            return "none"
        return "ranking" if self.ranking_part(r) > self.recompute_part(r) else "recompute"


def decompose(c: Curves, rule: str, source: str) -> Decomposition:
    """`rule`'s decomposition from curves that measured it and its ranking oracle (kl_curves)."""
    return Decomposition(source=source, rule=rule, n_inputs=len(c.items), reuse=c.reuse, rule_kl=dict(c.kl[rule]),
                         ranking=dict(c.ranking[rule]), patch=dict(c.kl["oracle"]))


def deviation_top_share(c: Curves, frac: float) -> float:
    """Share of full reuse's KV deviation held by the top ceil(frac N) tokens, mean over layers 1.. and inputs."""
    devs = [it.deviation for it in c.items]
    return statistics.fmean(bw.top_share(d[i][None], frac) for d in devs for i in range(1, len(d)))


@dataclass(frozen=True)
class ChunkLength:
    """One chunk length of the built-in items: the decomposition and how concentrated the deviation is."""
    chunk_tokens: int
    n_context: int    # context tokens of each input (prefix + chunks)
    n_chunks: int
    split: Decomposition
    top_share: float  # share of the KV deviation held by the top `ChunkLengths.top` of the tokens


@dataclass(frozen=True)
class ChunkLengths:
    """The same items and rule at several chunk lengths (rows, shortest first)."""
    rule: str
    ratio: float    # the ratio the question is asked at (15%)
    top: float      # the token share top_share is measured for (also 15%)
    reference: int  # the chunk length the others are held against (the run's)
    rows: list

    def row(self, chunk_tokens: int) -> ChunkLength:
        return next(r for r in self.rows if r.chunk_tokens == chunk_tokens)

    def needed(self, row: ChunkLength) -> float | None:
        """The smallest measured ratio at which `row`'s rule is as close to full prefill as the rule is at
        `ratio` with the reference chunks; None when no measured ratio gets there."""
        target = self.row(self.reference).split.rule_kl[self.ratio]
        return next((r for r in sorted(row.split.ratios) if row.split.rule_kl[r] <= target * (1 + 1e-9)), None)


def chunk_length_study(model, tok, *, n_items: int, lengths, reference: int, ratios, ratio: float, rule: str,
                       model_id: str, top: float, recompute: bool = False, progress: bool = True) -> ChunkLengths:
    """The built-in items cut to `reference` and to each of `lengths` tokens per chunk, every rule and its
    ranking oracle at `ratios` (kl_curves with --curve's settings: the reference shares --curve's result)."""
    rows = []
    for n in sorted({*lengths, reference}):
        rags = built_in_inputs(tok, n_items, n)
        c = kl_curves(model, tok, rags, ratios=ratios, ratio=ratio, rules=blend_rules.RULE_NAMES,
                      ranked=(rule, *(r for r in blend_rules.RULE_NAMES if r != rule)), model_id=model_id,
                      recompute=recompute, progress=progress, name="blend-smollm2-curve")
        rows.append(ChunkLength(n, c.items[0].n_context, len(c.items[0].chunk_lens),
                                decompose(c, rule, f"built-in items, {n}-token chunks"), deviation_top_share(c, top)))
    return ChunkLengths(rule, ratio, top, reference, rows)


# ------------------------------------------------------------------------------------ a rule whose count adapts
@dataclass(frozen=True, kw_only=True)
class Matched:
    """The adaptive rule at one share target beside flat recomputing the same mean share (means over inputs)."""
    target: float          # share of the deviation measured at the check layer that the kept set holds
    recomputed: float      # its recomputed share of a full prefill's context-token layers
    spread: tuple          # (least, most) recomputed share over the inputs: how far the count adapted
    kl: float
    flat_ratio: float      # flat's r for the same mean share
    flat_recomputed: float
    flat_kl: float


@dataclass(frozen=True)
class RuleComparison:
    source: str
    layer: int   # the adaptive rule's check layer (0: layer 0's attention deviation)
    floor: float  # its least ratio
    rows: list   # Matched, one per target


@torch.no_grad()
def _first_token_kl(model, rd: bw.RagDoc, lp_full: torch.Tensor, pre, rule, ratio: float) -> tuple[float, float]:
    """(first-token KL(full || blend), recomputed share of the context-token layers) of one blend."""
    lg, tr = bw.blend(model, rd, rd.chunks, ratio, rule=rule, pre=pre, trace=True)
    N, L = rd.doc.shape[1], model.cfg.n_layers
    share = (N + sum(t.shape[1] for t in tr.recomputed)) / (L * N)
    return float(kl_divergence(lp_full, lg[0, -1].log_softmax(-1))), share


def flat_share(n_context: int, ratio: float, n_layers: int) -> float:
    """Flat's recomputed share of the context-token layers at r: layer 0 in full, ceil(r N) after it."""
    return blend_rules.recompute_share(n_context, ratio, n_layers, "flat")


def flat_ratio_for(share: float, sizes: list[int], n_layers: int) -> float:
    """The r (one of the ratios at which some input's count steps) whose mean flat_share over inputs of
    `sizes` context tokens is nearest to `share`."""
    steps = sorted({k / n for n in sizes for k in range(n + 1)})
    return min(steps, key=lambda r: abs(statistics.fmean(flat_share(n, r, n_layers) for n in sizes) - share))


def compare_rules(model, tok, rags: list[RagInput], *, targets, layer: int, floor: float, model_id: str,
                  source: str, recompute: bool = False, progress: bool = True) -> RuleComparison:
    """Adaptive(layer, share=t) at ratio `floor` for each target t, then flat at the ratio recomputing the
    same mean share over the inputs (flat_ratio_for); first-token KL to full prefill (cached)."""
    from tqdm import tqdm

    from common.checkpoints import cached_result

    def compute():
        inputs = []
        with torch.no_grad():
            for rag in tqdm(rags, desc="adaptive rule", disable=not progress):
                rd = bw.rag_doc(rag)
                lp = model(rd.tokens, last=True)[0][0, -1].log_softmax(-1)
                inputs.append((rd, lp, bw.precompute_chunks(model, rd.doc, rd.chunks)))
        adaptive = [[_first_token_kl(model, rd, lp, pre, blend_rules.Adaptive(layer=layer, share=t), floor)
                     for rd, lp, pre in inputs] for t in targets]
        L = model.cfg.n_layers
        sizes = [rd.doc.shape[1] for rd, _, _ in inputs]
        ratios = [flat_ratio_for(statistics.fmean(s for _, s in runs), sizes, L) for runs in adaptive]
        flat = [[_first_token_kl(model, rd, lp, pre, blend_rules.FLAT, r) for rd, lp, pre in inputs] for r in ratios]
        return {"adaptive": adaptive, "flat": flat, "ratios": ratios}

    ident = {"model": model_id, "inputs": inputs_digest(rags), "targets": targets,
             "layer": layer, "floor": floor}
    res = cached_result("blend-smollm2-adaptive", ident, compute, refit=recompute, tag="04", flag="--recompute")
    mean = lambda runs, i: statistics.fmean(x[i] for x in runs)  # noqa: E731
    rows = [Matched(target=t, recomputed=mean(a, 1), spread=(min(s for _, s in a), max(s for _, s in a)),
                    kl=mean(a, 0), flat_ratio=r, flat_recomputed=mean(f, 1), flat_kl=mean(f, 0))
            for t, a, f, r in zip(targets, res["adaptive"], res["flat"], res["ratios"])]
    return RuleComparison(source, layer, floor, rows)
