"""How 04's Part 5 (CacheBlend on a real LLaMA, handout §5.1-5.4) is shown: show_real(page, r, s) lays out
Parts 5 and 5a-5i, one show_* each with its tables and notes, and its `--json` keys taken from the
result's fields in one place (one add_json call). Every rule of blend_rules.RULES that rag.real_experiment
measured gets its row: a rule added there is shown with no change here. Nothing here computes a lecture
figure."""
from __future__ import annotations

import statistics

from lecture27 import blend_rules
from lecture27.blend import rag as blend_rag
from lecture27.blend import rag_study
from lecture27.blend import prefix_caching as pc
from lecture27.blend.page import HANDOUT, HOWS, add_json, add_table, pk, saved_verdict
from common.english import RAG_ITEMS
from common.present import (DASH, Chart, Field, Page, Ref, Row, Series, Table, Val, change, chart_figure,
                            cols, handout, handout_text, pct1, points, table_of)


def show_real(page: Page, r: rag_study.Real, s) -> None:
    """Part 5 and its sub-parts, in the handout's order; --curve adds 5a-b and 5g-i."""
    run = r.run
    page.part("Part 5", "§5.1-5.4", f"CacheBlend on a real LLaMA: {r.model_name} ({r.n_layers} layers)")
    page.say(inputs_line(r))
    page.say(cache_line(run))
    add_json(page, {"real_items": len(run.items), "real_source": r.source,
                    "real_answers": [it.text for it in run.items]})
    show_real_prefix(page, r, s)
    if run.curve_mode:
        show_real_curve(page, r, s)
    else:
        blends = (len(s.real_curve_ratios) * (2 * len(blend_rules.RULE_NAMES) + 1 + len(blend_rules.INPUT_RULE_NAMES))
                  + len(blend_rules.QUERY_RULES) * len(s.real_query_j))
        page.say(f"  Parts 5a-b and 5g-k, the quality curve of every selection rule, random and the two oracles at "
                 f"{', '.join(f'{x:.0%}' for x in s.real_curve_ratios)}, every rule's ranking oracle, the query rules "
                 f"over j, shorter chunks and a rule whose count adapts: --curve (about {blends} blends per item the "
                 "first time, then cached; --items 8 for all eight)")
    show_real_ttft(page, r, s)
    show_real_answers(page, r, s)
    show_real_mask(page, r, s)
    show_real_insights(page, r, s)
    show_real_split(page, r, s)
    show_input_rules(page, r, s)
    if run.curve_mode:
        show_query_depths(page, r, s)
        show_rule_splits(page, r, s)
        if r.chunks:
            show_chunk_lengths(page, r.chunks, s)
        show_adaptive(page, r, s)
        real_curve_figure(page, r, s)


def inputs_line(r: rag_study.Real) -> str:
    """The run's inputs in one line: how many, from where, the prefix, the chunks and the question (ranges)."""
    items = r.run.items
    span = lambda xs: f"{min(xs)}" if min(xs) == max(xs) else f"{min(xs)}-{max(xs)}"  # noqa: E731
    lens, prefix = [n for it in items for n in it.chunk_lens], items[0].n_context - sum(items[0].chunk_lens)
    built_in = r.source == rag_study.BUILT_IN
    of = f" (the first {len(items)} of {len(RAG_ITEMS)}; --items sets how many)" if built_in else ""
    return (f"  {len(items)} inputs from {r.source}{of}: {prefix}-token chat prefix + "
            f"{span([len(it.chunk_lens) for it in items])} chunks of {span(lens)} tokens (each precomputed alone "
            f"behind the prefix) + a {span([it.n_question for it in items])}-token question")


def cache_line(run: blend_rag.Experiment) -> str:
    """What was measured (the curve or the KL at r), whether it came from the cache; when and where the TTFT
    was measured."""
    w = run.ttft_when
    return ("  the curve" if run.curve_mode else "  KL") + (
        " loaded from the cache (--recompute computes it again)" if run.loaded_from_cache else
        f" computed in {run.compute_seconds:.0f} s and cached") + (
        f"; TTFT measured on {w['machine']} on {w['when']} (--remeasure measures it again)" if w["loaded"] else
        f"; TTFT measured in this run on {w['machine']}")


# ============================================================================ §5.1 measured
def prefix_json(x: pc.Measured) -> dict:
    """Part 5 §5.1's keys: per k, each method's TTFT, the saved shares and the KL."""
    return {"real_prefix_k": x.ks, "real_full_ttft_s": x.full_ttft_s, "real_prefix_ttft_s": x.prefix_ttft_s,
            "real_reuse_ttft_s": x.reuse_ttft_s, "real_blend_ttft_s": x.blend_ttft_s,
            "real_prefix_saved_share": x.prefix_saved_share, "real_blend_saved_share": x.blend_saved_share,
            "real_prefix_kl": x.prefix_kl, "real_reuse_kl": x.reuse_kl, "real_blend_kl": x.blend_kl}


def show_real_prefix(page: Page, r: rag_study.Real, s) -> None:
    """§5.1 measured: prefix caching, full reuse and CacheBlend against k chunks (prefix_caching.measured)."""
    x = r.prefix
    if x is None:
        page.say("  §5.1 (prefix caching against k chunks) runs on the built-in items only, not on --passages.")
        return
    fields = [Field("k", "{}", get="ks"), Field("tokens", get="n_tokens"),
              *[Field(f"{m} s", "{:.2f}", get=f"{m}_ttft_s") for m in ("full", *HOWS)],
              *[Field(f"{m} saves", "{:.0%}", get=f"{m}_saved_share") for m in ("prefix", "blend")],
              *[Field(f"KL {m}", f, get=f"{m}_kl") for m, f in zip(HOWS, ("{:+.0e}", "{:.4f}", "{:.4f}"))]]
    cache = " (loaded from the cache)" if x.loaded else f" (computed in {x.compute_seconds:.0f} s, cached)"
    add_table(page, table_of(f"Part 5 (§5.1). Prefix caching, full reuse and CacheBlend {x.ratio:.0%} ({x.rule}) "
                             f"against k chunks of {x.chunk_tokens} tokens:\n  TTFT = CPU time of one thread (median "
                             f"of {x.n_items} item(s), --prefix-items; chunks' KV in memory); KL(full prefill || "
                             f"method), first answer token, nats{cache}",
                             "§5.1", fields, points(x, fields), "blend.prefix_caching.measured", real_prefix_notes(x)))
    add_json(page, prefix_json(x))


def real_prefix_notes(x: pc.Measured) -> list[str]:
    """How the saved shares and the KL move with k; whether prefix caching's KL is rounding (its reuse exact)."""
    exact = max(abs(v) for v in x.prefix_kl)
    return [saved_verdict("The share of full prefill's time prefix caching saves", x.prefix_saved_share) + "; "
            + saved_verdict(f"CacheBlend {x.ratio:.0%}'s", x.blend_saved_share) + ".",
            (f"Prefix caching's KL is zero up to float32 rounding (|KL| <= {exact:.0e}): the first chunk's stored "
             "KV is what a full prefill computes for it, its reuse is exact." if exact < 1e-6 else
             f"Prefix caching's KL reaches {exact:.1e}: more than rounding.") + " Full reuse's KL "
            + change(x.reuse_kl[0], x.reuse_kl[-1], "{:.3f}") + " with k, CacheBlend's "
            + change(x.blend_kl[0], x.blend_kl[-1], "{:.3f}") + "."]


def show_real_mask(page: Page, r: rag_study.Real, s) -> None:
    """The bottom-right mask's cost on SmolLM2, from the same runs as §5.1's table."""
    x = r.prefix
    if x is None:
        return
    pos, wrong = x.mask_kl["position"], x.mask_kl["bottom-right"]
    worse = all(w > p for p, w in zip(pos, wrong))
    add_table(page,
              Table(title=f"Pitfall (§5.3): CacheBlend {x.ratio:.0%} ({x.rule}) with the position mask and with the "
                          "bottom-right mask of the released blenders,\n  KL(full prefill || method) of the first "
                          f"answer token (mean of {x.n_items} item(s))", section="§5.3",
                          cols=cols("k chunks", ("position mask", "{:.4f}"), ("bottom-right mask", "{:.4f}"),
                               ("bottom-right / position", "{:.2f}x")),
                          rows=[Row([k, p, w, w / p]) for k, p, w in zip(x.ks, pos,
                                                                         wrong)],
                    source="blend.prefix_caching.measured",
                          notes=[why_the_mask_is_wrong_real(), "The bottom-right mask " + (
                              "moves the first token further from full prefill at every k" if worse else
                              "is not worse at every k") + f": at k = {x.ks[-1]}, {wrong[-1]:.4f} against "
                                                           f"{pos[-1]:.4f}."]))
    add_json(page, {"real_mask_k": x.ks[-1], "real_mask_position_kl": pos[-1], "real_mask_pitfall_kl": wrong[-1],
                    "real_mask_kl": x.mask_kl})


def why_the_mask_is_wrong_real() -> str:
    return ("Why it is wrong: the mask takes the recomputed tokens for the last ones of the context, so a token "
            "picked earlier also attends to the chunks after it, a future no prefill shows (LMCache#1152, "
            "CacheBlend#21).")


# ============================================================================ §5.3-5.4: the rules at r
def show_real_curve(page: Page, r: rag_study.Real, s) -> None:
    run = r.run
    at, ratios, reuse, methods = run.ratio, run.ratios, run.kl_reuse, run.methods[1:]
    for name, kl, more, title in (
            ("5a", run.curve, [(f"{at:.0%} / reuse", "{:.2f}x")],
             f"Mean KL(full prefill || method) of the first answer token, nats, vs recompute ratio r\n  (full reuse: "
             f"{reuse:.4f}; random: {blend_rag.RANDOM_RULE}'s counts, tokens at random; ranking-oracle: {run.rule}'s "
             "counts, the tokens\n  with the largest true deviation, recomputed; oracle (the patch oracle): the full "
             "prefill's K, V of the top r N\n  tokens by true deviation, at every layer)"),
            ("5b", run.curve_answer, [], f"The same, mean over the first {run.kl_tokens} answer tokens, "
             f"teacher-forced on\n  full prefill's greedy answer (full reuse: {run.kl_answer_reuse:.4f})")):
        add_table(page, Table(title=f"Part {name} (§5.3). {title}", section="§5.3",
                              cols=cols("rule", *[(f"r={x:.0%}", "{:.4f}") for x in ratios], *more),
                              rows=[Row([m,
                                         *[kl[m][f"{x:g}"] for x in ratios]] + [kl[m][f"{at:g}"] / reuse] * len(more))
                               for m in methods], source="blend.rag.real_experiment"))


def ttft_json(r: rag_study.Real) -> dict:
    """Part 5c's keys: each method's TTFT, the reported rule's speed-up, every rule's counts, the run's setup."""
    run = r.run
    return {"real_ttft_s": {m: run.ttft[m] for m in ("full prefill", *blend_rules.ALL_RULE_NAMES)},
            "real_ttft_speedup": run.ttft["full prefill"] / run.ttft[run.rule],
            "real_counts": {m: run.counts[m] for m in blend_rules.ALL_RULE_NAMES}, "real_rule": run.rule,
            "real_curve_measured": run.curve_mode, "real_threads": run.threads,
            "real_best_rule_this_run": run.best if run.curve_mode else None, "real_ttft_tier": run.ttft_tier,
            "real_ttft_fetch_s": run.ttft_fetch_s}


TIER_NAMES = {"ram": "RAM", "disk": "local disk, its pages dropped before each read"}


def show_real_ttft(page: Page, r: rag_study.Real, s) -> None:
    run = r.run
    t, k, ref = run.ttft, f"{run.ratio:g}", handout(HANDOUT, "real_ttft", s)
    counts = lambda c: " ".join(map(str, c[:4])) + f" ... {c[-1]}"  # noqa: E731
    rows = [Row(["full prefill", t["full prefill"], 1.0, "100%", None, None, None])]
    rows += [Row([m, t[m], t["full prefill"] / t[m], run.share[m], run.curve.get(m, {}).get(k), run.score.get(m),
                  Val(run.counts[m], fmt=counts)]) for m in blend_rules.ALL_RULE_NAMES]
    add_table(page,
              Table(title=f"Part 5c (§5.4). Time to first token at r = {run.ratio:.0%}, CPU wall clock, median of "
                          f"{run.ttft_items} input(s), {run.threads} torch thread(s),\n  chunks' KV fetched from "
                          f"a real store ({TIER_NAMES[run.ttft_tier]}: {run.ttft_fetch_bytes / 1e6:.1f} MB of FP16 "
                          f"records in {run.ttft_fetch_s * 1e3:.0f} ms) + shift_kv + blend; noisy on a shared machine."
                          + (
                              f" Paper (GPU): {ref.figure}" if isinstance(ref, Ref) else ""),
                          section="§5.4", cols=cols("rule", ("TTFT s", "{:.2f}"), ("speed-up", "{:.2f}x"),
                                                    ("recomputed", pct1),
                                       ("KL first token", "{:.4f}"), ("KL removed / s", "{:.2f}"),
                                       "tokens at layers 1 2 3 4 ... last"), rows=rows,
                    source="blend.rag.real_experiment",
                          notes=real_notes(r) + [recomputed_note(r)]))
    add_json(page, ttft_json(r))


def real_notes(r: rag_study.Real) -> list[str]:
    """The rule reported as CacheBlend and the best rule of this run (how far the oracles are: Part 5f)."""
    run = r.run
    t, k, rule, reuse, kl = run.ttft, f"{run.ratio:g}", run.rule, run.kl_reuse, run.curve
    gain = lambda m: f"{1 - kl[m][k] / reuse:.0%} of full reuse's KL removed in {t[m]:.2f} s"  # noqa: E731
    notes = []
    if run.curve_mode:                # every rule measured: the one with the most quality per second
        rank = sorted(run.score, key=run.score.get, reverse=True).index(r.default_rule) + 1
        notes.append(f"quality per TTFT = share of full reuse's KL removed / TTFT; best in this run: {run.best} "
                     f"({gain(run.best)}); the default --rule {r.default_rule} " + (
                         "is that rule." if rank == 1 else f"ranks {rank} of {len(run.score)} (one run's timings on a "
                         "shared CPU can reorder rules whose recomputed shares are close)."))
    notes.append(f"CacheBlend below = --rule {rule} ({gain(rule)})." + (
        "" if run.curve_mode else f" The default, {r.default_rule}, was chosen on the public input sets at 15% "
                                  "(04's RULE says why); Part 5j sets it beside flat and the oracles, --curve "
                                  "measures every rule at every ratio."))
    return notes


def recomputed_note(r: rag_study.Real) -> str:
    """Why "recomputed" is above r: every rule computes layer 0 in full (and a check-layer rule its layers up to
    the check), so its share of a full prefill's context-token layers is (full layers + the rest's counts) / L."""
    run, L = r.run, r.n_layers
    n = run.items[0].n_context
    groups: dict[tuple, list] = {}
    for m in blend_rules.ALL_RULE_NAMES:
        c = run.counts[m]
        full = 1 + next((i for i, x in enumerate(c) if x < n), len(c))   # layer 0 and the leading full layers
        groups.setdefault((full, tuple(c[full - 1:]), round(run.share[m], 12)), []).append(m)
    said = []
    for (full, rest, share), rules in groups.items():
        if not rest:
            said.append(f"{', '.join(rules)}: every layer in full = {share:.1%}")
            continue
        frac = sum(rest) / (len(rest) * n)
        layers = "layer 0" if full == 1 else f"layers 0-{full - 1}"
        each = (f"{rest[0]:,} of the {n:,} tokens ({frac:.1%}) at each of layers {full}-{L - 1}"
                if len(set(rest)) == 1 else f"{frac:.1%} of the tokens on average at layers {full}-{L - 1}")
        extra = share - (full + (L - full) * frac) / L
        said.append(f"{', '.join(rules)}: {layers} in full, then {each}" + (
            f", + the question's pass over full reuse's cache ({extra:.1%})" if extra > 1e-9 else "") +
            f": ({full} + {L - full} x {frac:.1%}) / {L}" + (f" + {extra:.1%}" if extra > 1e-9 else "") +
            f" = {share:.1%}")
    first = "" if len({it.n_context for it in run.items}) == 1 else " (the first input's)"
    return (f"recomputed: the share of a full prefill's {L} layers x {n:,} context tokens{first} a rule computes. "
            "Layer 0 is computed in full by every rule (blend's check reads its attention), and a check-layer rule "
            "also computes every layer up to its check in full: " + "; ".join(said) + ".")


def answers_json(run: blend_rag.Experiment) -> dict:
    """Part 5d's keys: full reuse's KL, the rule's (as CacheBlend), random's and the patch oracle's at r, the
    curves, how many greedy answers match full prefill's."""
    k, at = f"{run.ratio:g}", pk(run.ratio)
    return {"real_kl_reuse": run.kl_reuse, "real_kl_answer_reuse": run.kl_answer_reuse,
            f"real_kl_blend{at}": run.curve[run.rule][k], f"real_kl_random{at}": run.curve["random"][k],
            f"real_kl_oracle{at}": run.curve["oracle"][k], "real_same_answer": run.same_answer,
            "real_kl_curve": run.curve, "real_kl_answer_curve": run.curve_answer}


def show_real_answers(page: Page, r: rag_study.Real, s) -> None:
    run = r.run
    k, n = f"{run.ratio:g}", len(run.items)
    first = {"full prefill": "0", "full reuse": run.kl_reuse, **{m: c[k] for m, c in run.curve.items()}}
    answer = {"full prefill": "0", "full reuse": run.kl_answer_reuse, **{m: c[k] for m, c in run.curve_answer.items()}}
    shown = run.rule if run.rule in run.items[0].text else blend_rules.blend_rule_of(run.rule)
    add_table(page, Table(title=f"Part 5d (§5.3). KL and greedy answers at r = {run.ratio:.0%} (the answers of --rule "
                          f"{shown} shown below; the input rules' KL: Part 5j)", section="§5.3",
                          cols=cols("method", ("KL first token", "{:.4f}"), (f"KL first {run.kl_tokens} tokens",
                                                                             "{:.4f}"),
                               ("same greedy answer", lambda x: f"{x}/{n}")),
                          rows=[Row([m, first[m], answer[m], same]) for m, same in run.same_answer.items()],
                          source="blend.rag.real_experiment"))
    add_json(page, answers_json(run))
    for it in run.items:
        page.say(answer_lines(it, shown))


def answer_lines(it: blend_rag.Answered, rule: str) -> str:
    """One input's question, its reference answer where it has one, and the greedy answers."""
    return f"\n{it.question}" + (f"\n  (reference: {it.reference})" if it.reference else "") + "".join(
        f"\n  {m:14s} {it.text[m].strip()!r}" for m in ("full prefill", "full reuse", rule, "random") if m in it.text)


def show_real_insights(page: Page, r: rag_study.Real, s) -> None:
    toy, top, d = r.toy, pk(s.top_share), r.insights
    three = lambda f: lambda xs: " / ".join(f(x) for x in (min(xs), statistics.median(xs), max(xs)))  # noqa: E731
    add_table(page,
              Table(title=f"Part 5e (§5.3). The two insights on a real model\n  (deviation = full reuse's KV minus "
                          f"full prefill's, layers 1-{len(d.top_per_layer)})", section="§5.3",
                          cols=cols("insight", ("SmolLM2-135M", pct1), ("record world", pct1),
                                    "handout / paper"), rows=[
        Row([f"top {s.top_share:.0%} of tokens: share of KV deviation", d.top_share,
             toy.top_share if toy else None, handout_text(handout(HANDOUT, "top_share", s))]),
        Row(["  per layer: min / median / max", Val(d.top_per_layer, fmt=three(pct1)), None, DASH]),
        Row(["rank correlation of deviation, adjacent layers: min / median / max",
             Val(d.rank_corr, fmt=three("{:.2f}".format)),
             " ".join(f"{c:.2f}" for c in toy.rank_corr) if toy else None,
             handout_text(handout(HANDOUT, "rank_corr", s))])],
        source="blend.rag_study.deviation"))
    add_json(page, {f"real_top{top}_deviation_share": d.top_share, f"real_top{top}_per_layer": d.top_per_layer,
                    "real_adjacent_layer_rank_corr": d.rank_corr})


# ============================================================================ §5.3: rules that read the input
INPUT_SHOWN = ("flat", *blend_rules.INPUT_RULE_NAMES)


def removed(kl: float, reuse: float) -> float:
    """The share of full reuse's KL a method removes."""
    return 1 - kl / reuse


def show_input_rules(page: Page, r: rag_study.Real, s) -> None:
    """flat, the rules that read the input (the question's attention, alone and with layer 0's deviation;
    EPIC's chunk starts) and flat's two oracles at each measured ratio: KL and the share of full reuse's
    KL removed; with --curve, the same at r with every chunk prefilled alone at position 0."""
    run = r.run
    ratios, reuse = run.ratios, run.kl_reuse
    shown = [m for m in (*INPUT_SHOWN, "random") if m in run.curve]
    rows = [Row([m, *[run.curve[m][f"{x:g}"] for x in ratios], removed(run.curve[m][f"{run.ratio:g}"], reuse),
                 run.ttft.get(m), run.share.get(m)]) for m in shown]
    oracle = run.ranking.get("flat")
    if oracle:
        rows.append(Row(["ranking oracle (flat's counts)", *[oracle[f"{x:g}"] for x in ratios],
                         removed(oracle[f"{run.ratio:g}"], reuse), None, None]))
    rows.append(Row(["patch oracle", *[run.curve["oracle"][f"{x:g}"] for x in ratios],
                     removed(run.curve["oracle"][f"{run.ratio:g}"], reuse), None, None]))
    add_table(page, Table(title=f"Part 5j (§5.3). Ranking by what the question reads: mean first-token KL(full prefill "
                          f"|| rule), nats (full reuse: {reuse:.4f});\n  query: flat's counts, the tokens the question "
                          "attends to most over full reuse's cache, layers 1 to the last;\n  query+dev: that and layer "
                          "0's attention deviation, each a share of its total;\n  chunk-start: the first tokens of "
                          "every chunk (EPIC's LegoLink); TTFT as Part 5c (with the question's pass)",
                          section="§5.3", cols=cols("rule", *[(f"r={x:.0%}", "{:.4f}") for x in ratios],
                                       (f"removed at {run.ratio:.0%}", pct1), ("TTFT s", "{:.2f}"),
                                       ("recomputed", pct1)),
                          rows=rows, source="blend.rag.input_rule_curves", notes=input_rule_notes(r)))
    if run.no_prefix:
        show_no_prefix(page, r)
    add_json(page, {"real_input_rules": list(blend_rules.INPUT_RULE_NAMES),
                    "real_kl_removed": {m: removed(run.curve[m][f"{run.ratio:g}"], reuse) for m in shown}})


def input_rule_notes(r: rag_study.Real) -> list[str]:
    """Which rule is closest to full prefill at each measured ratio, and the run's rule against flat at r."""
    run, k = r.run, f"{r.run.ratio:g}"
    rules = [m for m in INPUT_SHOWN if m in run.curve]
    best = {x: min(rules, key=lambda m: run.curve[m][f"{x:g}"]) for x in run.ratios}
    rule, flat = run.rule, run.curve.get("flat", {}).get(k)
    notes = ["closest to full prefill: " + ", ".join(f"{x:.0%} {m}" for x, m in best.items()) + "."]
    if flat is not None and rule != "flat" and rule in run.curve:
        mine = run.curve[rule][k]
        notes.append(f"--rule {rule} at {run.ratio:.0%}: {mine:.4f} against flat's {flat:.4f} (" + (
            f"{1 - mine / flat:.0%} less" if mine < flat else f"{mine / flat - 1:.0%} more" if mine > flat else
            "the same") + f"), {run.ttft[rule]:.2f} s against {run.ttft['flat']:.2f} s to the first token.")
    return notes


def show_no_prefix(page: Page, r: rag_study.Real) -> None:
    """At r: full reuse, flat and the input rules when every chunk is prefilled alone at position 0 (each its
    own attention sink, as EPIC stores chunks) beside the same with the shared chat prefix."""
    run, k, x = r.run, f"{r.run.ratio:g}", r.run.no_prefix
    rows = [Row([m, x[m], run.kl_reuse if m == "full reuse" else run.curve[m][k]])
            for m in ("full reuse", *INPUT_SHOWN, "oracle") if m in x]
    add_table(page,
              Table(title=f"Part 5j (§5.3). At r = {run.ratio:.0%}, every chunk prefilled alone at position 0 (the "
                          "chat prefix part of the first chunk, each chunk\n  its own attention sink) beside every "
                          "chunk prefilled behind the shared chat prefix; mean first-token KL, nats", section="§5.3",
                          cols=cols("method", ("alone at 0", "{:.4f}"), ("behind the prefix", "{:.4f}")), rows=rows,
                          source="blend.rag.input_rule_curves"))
    add_json(page, {"real_kl_no_prefix": x})


def show_query_depths(page: Page, r: rag_study.Real, s) -> None:
    """Each query rule at r reading the question's attention at layers 1..j: KL against TTFT on this CPU."""
    run, q = r.run, r.run.query
    js = q["depths"]
    if not js:
        return
    rows = [Row([j, *[q[key][m][i] for m in blend_rules.QUERY_RULES for key in ("kl", "ttft")],
                 q["share"]["query"][i]]) for i, j in enumerate(js)]
    k = f"{run.ratio:g}"
    rows.append(Row(["flat", run.curve["flat"][k], run.ttft["flat"], None, None, run.share["flat"]]))
    add_table(page,
              Table(title=f"Part 5k (§5.4). The query rules at r = {run.ratio:.0%} reading the question's attention "
                          "at layers 1..j: mean first-token KL against TTFT\n  (CPU wall clock as Part 5c, the "
                          "question's pass over layers 0..j included); flat beside them", section="§5.4",
                          cols=cols("j", *[(f"{head} {m}", fmt) for m in blend_rules.QUERY_RULES
                                      for head, fmt in (("KL", "{:.4f}"), ("TTFT s", "{:.2f}"))],
                               ("recomputed",
                                pct1)), rows=rows, source="blend.rag.real_experiment", notes=depth_notes(r)))
    add_json(page, {"real_query_j": js, f"real_query_kl{pk(run.ratio)}": q["kl"]["query"],
                    "real_query_ttft_s": q["ttft"]["query"], f"real_query_dev_kl{pk(run.ratio)}": q["kl"]["query+dev"],
                    "real_query_dev_ttft_s": q["ttft"]["query+dev"]})


def depth_notes(r: rag_study.Real) -> list[str]:
    """The smallest j at which each query rule is closer to full prefill than flat, and what it costs."""
    run, q = r.run, r.run.query
    flat = run.curve["flat"][f"{run.ratio:g}"]
    out = []
    for m in blend_rules.QUERY_RULES:
        j = next((j for j, kl in zip(q["depths"], q["kl"][m]) if kl < flat), None)
        out.append(f"{m}: " + ("no j measured is closer to full prefill than flat" if j is None else
                               f"closer than flat first at j = {j}"
                               f" ({q['kl'][m][q['depths'].index(j)]:.4f} against {flat:.4f})"))
    return ["; ".join(out) + ". The question's pass adds (j + 1) layers of its own tokens; on the time model "
            "(Part 4) ranking by j layers also waits for their KV."]


# ============================================================================ §5.3: where the distance comes from
SPLIT_COLS = (("ranking oracle", "{:.4f}"), ("patch oracle", "{:.4f}"), ("ranking's part", "{:+.4f}"),
              ("recompute's part", "{:+.4f}"), "larger part")


def split_cells(d: blend_rag.Decomposition, x: float) -> list:
    return [d.rule_kl[x], d.ranking[x], d.patch[x], d.ranking_part(x), d.recompute_part(x), d.dominant(x)]


def show_real_split(page: Page, r: rag_study.Real, s) -> None:
    """The run's rule, its ranking oracle and the patch oracle at each measured ratio."""
    d, at = r.split, r.run.ratio
    add_table(page,
              Table(title=f"Part 5f (§5.3). Where {d.rule}'s distance from full prefill comes from, mean first-token "
                          "KL (nats)\n"
                          f"  ranking oracle: {d.rule}'s counts and nesting, its tokens picked by their true "
                          "deviation, recomputed by blend();\n  patch oracle: the full prefill's own K, V for as many "
                          "tokens of every layer, no recompute", section="§5.3",
                          cols=cols(("r", "{:.0%}"), (d.rule, "{:.4f}"), *SPLIT_COLS),
                          rows=[Row([x, *split_cells(d, x)]) for x in d.ratios], source="blend.rag.decompose",
                          notes=[split_verdict(d, at)]))
    add_json(page, {f"real_dominant{pk(at)}": d.dominant(at)})


def split_verdict(d: blend_rag.Decomposition, at: float) -> str:
    """Which part of the rule's distance to the patch oracle dominates at `at`, in the words the numbers allow."""
    gap, rank, rec = d.rule_kl[at] - d.patch[at], d.ranking_part(at), d.recompute_part(at)
    head = (f"at {at:.0%}: {d.rule} {d.rule_kl[at]:.4f}, its ranking oracle {d.ranking[at]:.4f}, the patch oracle "
            f"{d.patch[at]:.4f}: ")
    if gap <= 0:
        return head + f"{d.rule} is at or past the patch oracle for these inputs; neither part is left" + (
            "; the true ranking is further from full prefill than the rule's: here the tokens that deviate most are "
            "not the ones the answer needs most." if rank < 0 else ".")
    if rank <= 0:
        return head + ("the true ranking gains nothing over the rule's for these inputs: the whole distance is the "
                       "recompute's (recomputed tokens attend to neighbours that kept their stale K, V).")
    if rec <= 0:
        return head + "the whole distance is the ranking's: the rule picks the wrong tokens for these inputs."
    big = max(rank, rec)
    return head + (f"the {d.dominant(at)} dominates for these inputs ({big / gap:.0%} of the distance): " + (
        "a better ranking could remove it" if d.dominant(at) == "ranking" else
        "a better ranking could remove at most the rest; recomputed tokens attend to neighbours that kept their "
        "stale K, V") + ".")


def ranking_room(d: blend_rag.Decomposition, at: float, splits: dict) -> str:
    """How much a better ranking could still gain over the rule at `at` (the decomposition), and how close
    the rules measured come to the rule's ranking oracle."""
    gap = d.rule_kl[at] - d.patch[at]
    if gap <= 0:
        return f"at {at:.0%} {d.rule} is already at or past the patch oracle (Part 5f): no ranking has a gap to close."
    if d.ranking_part(at) <= 0:
        return f"at {at:.0%} the true ranking removes none of {d.rule}'s distance to the patch oracle (Part 5f)."
    best = min(splits.values(), key=lambda x: x.rule_kl[at])
    return (f"at {at:.0%} the true ranking would remove {min(1.0, d.ranking_part(at) / gap):.0%} of {d.rule}'s "
            f"distance to the patch oracle (Part 5f); " + (
                f"{best.rule} gets there ({best.rule_kl[at]:.4f} against {d.ranking[at]:.4f})." if
                best.rule_kl[at] <= d.ranking[at] else
                f"no rule measured gets there (closest: {best.rule} {best.rule_kl[at]:.4f} against "
                f"{d.ranking[at]:.4f})."))


def show_rule_splits(page: Page, r: rag_study.Real, s) -> None:
    """Every rule measured, its ranking oracle (same counts) and the patch oracle at the run's ratio."""
    at = r.run.ratio
    add_table(page, Table(title=f"Part 5g (§5.3). Every rule at r = {at:.0%} beside its own ranking oracle (the "
                          "check-layer rules compute layers 0-1 in full)", section="§5.3",
                          cols=cols("rule", ("KL", "{:.4f}"), *SPLIT_COLS),
                          rows=[Row([m, *split_cells(d, at)]) for m,
                                d in r.splits.items()], source="blend.rag.decompose"))
    add_json(page, {"real_kl_ranking_oracle": {m: d.ranking for m, d in r.splits.items()}})


def show_chunk_lengths(page: Page, c: blend_rag.ChunkLengths, s) -> None:
    """The built-in items at several chunk lengths: the rule's curve, the two oracles at `at`, how spread
    the deviation is, and the ratio that matches the reference length's quality at `at`."""
    at, ratios = c.ratio, c.row(c.reference).split.ratios
    rows = [Row([x.chunk_tokens, x.n_context, bounds_per_1k(x), x.split.reuse, *[x.split.rule_kl[q] for q in ratios],
                 x.split.ranking[at], x.split.patch[at], x.top_share, c.needed(x)]) for x in c.rows]
    add_table(page, Table(title=f"Part 5h (§5.3). Shorter chunks: the built-in items cut to each chunk length, mean "
                          f"first-token KL of full reuse, of {c.rule}\n  at each r and of its two oracles at {at:.0%}; "
                          "bounds/1k: chunk boundaries per 1,000 context tokens; last column: the least\n  measured r "
                          f"at which {c.rule} gets as close to full prefill as at {at:.0%} with {c.reference}-token "
                          "chunks", section="§5.3",
                          cols=cols("chunk", "context", ("bounds/1k", "{:.1f}"), ("reuse", "{:.4f}"),
                               *[(f"r={q:.0%}", "{:.4f}") for q in ratios], (f"ranking {at:.0%}", "{:.4f}"),
                               (f"patch {at:.0%}", "{:.4f}"), (f"top {c.top:.0%} hold", pct1),
                               (f"r like {c.reference}", "{:.0%}")), rows=rows, source="blend.rag.chunk_length_study",
                          notes=chunk_notes(c)))
    add_json(page, {"real_chunk_kl": {str(x.chunk_tokens): x.split.rule_kl for x in c.rows},
                    "real_chunk_top_share": {str(x.chunk_tokens): x.top_share for x in c.rows}})


def bounds_per_1k(x: blend_rag.ChunkLength) -> float:
    """Chunk boundaries per 1,000 context tokens: where full reuse loses what the chunks would have seen."""
    return 1000 * (x.n_chunks - 1) / x.n_context


def chunk_notes(c: blend_rag.ChunkLengths) -> list[str]:
    """Whether the ratio is enough at each other length, and why, from the table's numbers."""
    at, ref, notes = c.ratio, c.row(c.reference), []
    for x in c.rows:
        if x is ref:
            continue
        need = c.needed(x)
        enough = (f"{at:.0%} is enough" if need is not None and need <= at else
                  f"{at:.0%} is not enough: {c.rule} needs {need:.0%}" if need is not None else
                  f"{at:.0%} is not enough: no measured ratio up to {max(x.split.ratios):.0%} gets there")
        if need is None or need > at:
            enough += (f" (the patch oracle at {at:.0%}: {x.split.patch[at]:.4f}, against {c.rule}'s "
                       f"{ref.split.rule_kl[at]:.4f} with {c.reference}-token chunks)")
        spread = ("more spread" if x.top_share < ref.top_share else "no more spread")
        notes.append(f"{x.chunk_tokens}-token chunks: {enough}; {bounds_per_1k(x):.1f} chunk boundaries per 1,000 "
                     f"tokens against {bounds_per_1k(ref):.1f}, and the deviation is {spread} (the top {c.top:.0%} of "
                     f"tokens hold {x.top_share:.0%} of it against {ref.top_share:.0%}).")
    return notes


def show_adaptive(page: Page, r: rag_study.Real, s) -> None:
    """The adaptive rule at each share target beside flat recomputing the same mean share."""
    a = r.adaptive
    fields = [Field("share held", pct1, get="target"), Field("recomputed", pct1, get="recomputed"),
              Field("min-max over inputs", lambda x: f"{pct1(x[0])}-{pct1(x[1])}", get="spread"),
              Field("KL adaptive", "{:.4f}", get="kl"), Field("flat r", pct1, get="flat_ratio"),
              Field("flat recomputed", pct1, get="flat_recomputed"), Field("KL flat", "{:.4f}", get="flat_kl"),
              Field("closer", get=closer)]
    add_table(page, table_of(f"Part 5i (§5.3). A rule whose count adapts: layers up to {a.layer} in full, then the "
                             f"smallest set holding a share of layer {a.layer}'s\n  measured deviation (at least "
                             f"{a.floor:.0%} of the tokens), beside flat recomputing the same mean share; mean "
                             "first-token KL", "§5.3", fields, a.rows, "blend.rag.compare_rules",
                             [f"the adaptive rule is closer to full prefill than flat at "
                              f"{sum(closer(m) == 'adaptive' for m in a.rows)} of {len(a.rows)} matched shares; "
                              + ranking_room(r.split, r.run.ratio, r.splits)]))
    add_json(page, {"real_adaptive": a.rows})


def closer(m: blend_rag.Matched) -> str:
    """Which rule is closer to full prefill at one matched share ("same" when the KLs print alike)."""
    return "same" if abs(m.kl - m.flat_kl) < 5e-5 else "adaptive" if m.kl < m.flat_kl else "flat"


def real_curve_figure(page: Page, r: rag_study.Real, s) -> None:
    """First-answer-token KL against the recompute ratio, one line per rule, random, the ranking oracle of
    the run's rule and the patch oracle."""
    run = r.run
    style = {"random": dict(color="gray", ls="--"), "oracle": dict(color="black", ls=":"),
             "ranking-oracle": dict(color="black", ls="-.")}
    label = {"ranking-oracle": f"ranking oracle ({run.rule})", "oracle": "patch oracle"}
    lines = [Series([100 * x for x in run.ratios], [run.curve[m][f"{x:g}"] for x in run.ratios],
                    label.get(m, m), style=dict(marker="o", ms=3, **style.get(m, {}))) for m in run.methods[1:]]
    chart_figure(page, "04_real_curve_passages.png" if s.passages else "04_real_curve.png", Chart(
        series=lines, xlabel="recompute ratio r (%)", ylabel="KL(full prefill || method), first answer token (nats)",
        yscale="log",
        hlines=[(run.kl_reuse, dict(color="tab:red", lw=1, label="full reuse"))]),
        f"{r.model_name}: which tokens to recompute ({len(run.items)} inputs)", figsize=(7, 4))
