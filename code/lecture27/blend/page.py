"""How 04's Parts 0-4 and exercises 5-8 (handout §5.1-5.4) are shown: one show_<part>(page, result, s)
per Part (s: 04's Settings), each with its tables, notes and figures, and its `--json` keys taken from
the result's fields in one place (one add_json call, its dict built by a *_json function where it is
more than a few keys). The handout's figures that stand beside ours are HANDOUT, looked up only through
common.present.handout. Nothing here computes a lecture figure: the results come from prefix_caching.py,
city_reuse.py, record_blend.py, mask_pitfall.py and timing.py."""
from __future__ import annotations

import math

from lecture27.blend import timing as bt
from lecture27.blend import city_reuse
from lecture27 import loading_controller as lc
from lecture27.blend import mask_pitfall as mp
from lecture27.blend import prefix_caching as pc
from lecture27.blend import record_blend as rb
from lecture27.blend_world import DOC_LEN, N_RECORDS
from lecture27.record_trainer import plot_training
from common import gpu_reference as gr
from common import timemodel as tm
from common.present import (REFERENCE, Chart, Col, Handout, Page, Ref, Row, Series, Table,
                            change, chart_figure, cols, fact, handout, handout_text, pct1, plain, refs)

# The handout's figures, printed beside ours (reference only; nothing is computed from them), each with
# the inputs it holds for: a figure is shown only when the run's settings have these values.
C5, C5R20 = {"chunk_len": 5}, {"chunk_len": 5, "ratio": 0.20}
RAG = {"gpu": "A40", "rag_chunks": 6, "rag_chunk_tokens": 512, "rag_question": 32}
PAPER = {"gpu": "A40", "paper_context": 4096, "paper_ratio": 0.15, "paper_device": "NVMe SSD"}
B7, B70 = {"system": ("llama-2-7b", 1)}, {"system": ("llama-3.1-70b", 2)}   # a row's (model, A40s)
HANDOUT = Handout({
    **refs({"city_chunks": 3, "city_chunk_len": 8},
           {"city_ce_full": "0.6940", "city_ce_reuse": "0.6941", "city_kl": "0.00003"}),
    "train": Ref("12,000 steps, ~6 min, drop near step 5,000"),
    **refs(C5, {"split_full": "100.0%", "split_reuse": "8.8%", "unsplit_reuse": "unaffected",
                "rank_corr": "0.88-0.93"}),
    **refs(C5R20, {"split_random": "21.0%", "blend_c5": "99.4%", "layer0_coverage": "99.0%"}),
    "blend_c3": Ref("81.0%", {"chunk_len": 3, "ratio": 0.20}),
    **refs({"ex6_chunk_len": 6}, {"ex6_split": "0", "ex6_reuse": "100%"}),
    "top_share": Ref("98.0%", {**C5, "top_share": 0.15}),
    "nvme_vs_recompute llama-2-7b": Ref("~1x (NVMe almost as slow)", {**RAG, **B7}),
    "nvme_vs_recompute llama-3.1-70b": Ref("4.6x", {**RAG, **B70}),
    **refs({**PAPER, **B7}, {"paper_recompute llama-2-7b": "~3", "paper_load llama-2-7b": "~16"}),
    **refs({**PAPER, **B70}, {"paper_recompute llama-3.1-70b": "~7", "paper_load llama-3.1-70b": "~4"}),
    **refs({**RAG, "min_ratio": 0.15}, {"ttft_speedup": "2.2-3.3x", "throughput": "2.8-5x"}),
    "prefix_fewer": Ref("the more chunks, the less"),
    "blend_recompute": Ref("recomputes ~15%", {"min_ratio": 0.15}),
    **refs({"layers": 32, "read_ms": 10.0, "prefill_ms": 20.0, "min_ratio": 0.15},
           {"ex8_choice": "blend", "ex8_ratio": "50%", "ex8_ttft_ms": "~320"}),
    "ex8_full_ms": Ref("640", {"layers": 32, "prefill_ms": 20.0}),
    "real_ttft": Ref("2.2-3.3x", {"real_ratio": 0.15})})
HOWS = ("prefix", "reuse", "blend")       # the three ways to use stored KV against k chunks
# A real GPU's measurements (common/gpu_reference.json), in a column of their own beside the time model for that GPU
# (Part 4); a figure shows only while the run's GPU row is the one measured and the recompute ratio the one it ran.
MEASURED = Handout(gr.refs(gr.H200, {"gpu": "check_gpu", "ratio": "min_ratio"}))


def number(ref: Ref) -> float:
    """A handout figure as a number: "21.0%" -> 0.21, "~7" -> 7.0."""
    x = ref.figure.strip("~x")
    return float(x.rstrip("%")) / 100 if x.endswith("%") else float(x)


def pcts(xs):
    return " ".join(pct1(x) for x in xs)


def pk(r: float) -> str:
    """A ratio as the JSON keys name it: 0.2 -> "20" (split_acc_blend20), 0.125 -> "12.5"."""
    return f"{100 * r:.6g}"


def add_table(page: Page, t: Table) -> None:
    """A table on the page, a blank line before it unless it follows a heading."""
    if page.blocks and page.blocks[-1]["kind"] not in ("part", "exercise"):
        print()
    page.table(t)


def add_json(page: Page, keys: dict) -> None:
    """A Part's `--json` keys, as plain data."""
    page.data(**plain(keys))


def above(x: float, y: float) -> str:
    return "above" if x > y else "below" if x < y else "at"


# ============================================================================ §5.1 Part 0: prefix caching
def prefix_json(st: pc.PrefixStudy) -> dict:
    """Part 0's keys: per model, each method's TTFT (from the last device, and by device) and saved share."""
    out = {"prefix_k": st.ks, "full_ttft_s": {m: x.full_ttft_s for m, x in st.systems.items()}}
    for how in HOWS:
        out[f"{how}_ttft_s"] = {m: getattr(x, f"{how}_ttft_s")[st.devices[-1]] for m, x in st.systems.items()}
        out[f"{how}_ttft_by_device_s"] = {m: getattr(x, f"{how}_ttft_s") for m, x in st.systems.items()}
        out[f"{how}_saved_share"] = {m: getattr(x, f"{how}_saved_share") for m, x in st.systems.items()}
    return out


def show_prefix(page: Page, st: pc.PrefixStudy, s) -> None:
    """§5.1 on the time model: prefix caching, full reuse and CacheBlend against k chunks."""
    page.part("Part 0", "§5.1", f"Prefix caching is not enough: k retrieved chunks, only the first a prefix "
                                f"({s.gpu}, time model)")
    for m, x in st.systems.items():
        by = {how: getattr(x, f"{how}_ttft_s") for how in HOWS}      # method -> device -> TTFT per k
        rows = [Row([k, 1e3 * x.full_ttft_s[i], *[1e3 * by[how][d][i] for how in HOWS for d in st.devices]])
                for i, k in enumerate(st.ks)]
        add_table(page,
                  Table(title=f"{tm.get_model(m).name} ({tm.get_model(m).tag}) on {x.n_gpus} x {s.gpu}: TTFT (ms) "
                              f"of k chunks x {st.chunk_tokens} tokens + a {st.question}-token question; the KV read "
                              f"from {' or '.join(st.devices)}, pipelined (CacheBlend recomputes {s.min_ratio:.0%})",
                              section="§5.1", cols=cols("k", ("full prefill", "{:.0f}"),
                                           *[(f"{how} {d}", "{:.0f}") for how in HOWS for d in st.devices]),
                              rows=rows, source="blend.prefix_caching.system_prefix"))
    show_saved_share(page, st, s)
    prefix_figure(page, st, s)
    add_json(page, prefix_json(st))


def saved_verdict(name: str, shares: list) -> str:
    """How a saved share moves over k, in the words its values allow."""
    falls = all(b < a for a, b in zip(shares, shares[1:]))
    return f"{name} " + (f"falls with every chunk ({shares[0]:.0%} -> {shares[-1]:.0%})" if falls else
                         f"stays within {min(shares):.0%}-{max(shares):.0%}" if max(shares) - min(shares) < 0.1
                         else change(shares[0], shares[-1], "{:.0%}"))


def show_saved_share(page: Page, st: pc.PrefixStudy, s) -> None:
    r, names = f"{s.min_ratio:.0%}", {m: tm.get_model(m).name for m in st.systems}
    methods = (("prefix caching", "prefix", handout(HANDOUT, "prefix_fewer", s)), ("full reuse", "reuse", None),
               (f"CacheBlend {r}", "blend", handout(HANDOUT, "blend_recompute", s)))
    rows = [Row([f"{names[m]} {label}", *getattr(x, f"{how}_saved_share")], ref)
            for m, x in st.systems.items() for label, how, ref in methods]
    verdicts = "; ".join(f"{saved_verdict(f'{names[m]}: prefix caching', x.prefix_saved_share)}, "
                         f"{saved_verdict(f'CacheBlend {r}', x.blend_saved_share)}" for m, x in st.systems.items())
    add_table(page, Table(title="Share of full prefill's GPU time each method does not spend, by k", section="§5.1",
                          cols=cols("method", *[(f"k={k}", "{:.0%}") for k in st.ks]), rows=rows,
                          source="blend.prefix_caching.system_prefix",
                          notes=[f"{verdicts}. Only the first chunk can be a prefix, so prefix caching prefills the "
                                 f"other k - 1; CacheBlend recomputes {r} of every chunk wherever it sits, full reuse "
                                 "none (and loses what the chunks would have seen of each other, §5.2)."]))


def prefix_figure(page: Page, st: pc.PrefixStudy, s) -> None:
    ref, methods = handout(HANDOUT, "prefix_fewer", s), (("prefix", "tab:red", "-", "prefix caching"),
                                                         ("blend", "tab:blue", "--", f"CacheBlend {s.min_ratio:.0%}"))
    lines = [Series(st.ks, [100 * v for v in getattr(x, f"{how}_saved_share")], f"{tm.get_model(m).name}, {label}",
                    style=dict(marker=mark, color=color, ls=ls, **(dict(mfc="none", ms=8) if mark == "o" else {})))
             for (m, x), mark in zip(st.systems.items(), "oxs^") for how, color, ls, label in methods]
    chart_figure(page, "04_prefix_caching.png", Chart(series=lines, xlabel="k retrieved chunks",
                                                      ylabel="% of full prefill's GPU time saved",
                 axes={"ylim": (0, 100)}), f"§5.1: share of full prefill's GPU time saved\n(k chunks of "
                 f"{st.chunk_tokens} tokens" + (f"; handout: {ref.figure})" if isinstance(ref, Ref) else ")"),
                 figsize=(6.4, 4.2))


# ============================================================================ §5.1, exercise 5
def show_moved_chunk(page: Page, e: city_reuse.Moved, s) -> None:
    x = e.shift
    page.exercise(5, "§5.1", f"a chunk's KV computed at position 0, moved to position {x.shift} (city model, "
                             "all layers)")
    at = f"computed at {x.shift}"
    add_table(page, Table(title="", section="§5.1", cols=cols("quantity", ("max |difference|", "{:.1e}")), rows=[
        fact(f"K at 0 rotated by {x.shift} (shift_kv) vs K {at}", x.k_rotated_max_diff),
        fact(f"K at 0, not rotated, vs K {at}", x.k_unrotated_max_diff, fmt="{:.2f}"),
        fact(f"V at 0 vs V {at}", x.v_max_diff),
        fact("(largest |K| value, for scale)", x.k_max_abs, fmt="{:.2f}")],
        source="blend.city_reuse.shift_check", notes=[shift_note(x, e.rotated)]))
    add_json(page, {"ex5": x})


def shift_note(e: city_reuse.Shift, rotated: city_reuse.City) -> str:
    """What exercise 5's differences say (a difference under a thousandth of the largest |K| is rounding)."""
    tiny = 1e-3 * e.k_max_abs
    return (f"K must rotate once more by {e.shift} x theta (RoPE rotations add)" if e.k_rotated_max_diff < tiny
            < e.k_unrotated_max_diff else f"rotating K by {e.shift} x theta does not give K computed there") + (
        "; V never passes through RoPE, so it is reused as it is" if e.v_max_diff < tiny else "; V differs too") + (
        f". Full reuse with unrotated K: question cross-entropy {e.ce_unrotated:.4f} (rotated: "
        f"{rotated.ce_reuse:.4f}), KL from full prefill {e.kl_unrotated:.4f} (rotated: {rotated.kl:.5f}).")


# ============================================================================ §5.2 Part 1: the city language
def show_city(page: Page, c: city_reuse.City, s) -> None:
    page.part("Part 1", "§5.2", f"City language: {s.city_chunks} chunks x {s.city_chunk_len} tokens + a question of "
                                f"{s.city_chunk_len} tokens, {s.city_docs} documents")
    add_table(page, Table(title="Independent sentences: reuse loses " + ("nothing." if c.kl < 1e-3 else
                                                                   f"{c.kl:.4f} nats (KL)."),
                          section="§5.2", cols=cols("city language", ("ours", "{:.4f}")), rows=[
        fact("cross-entropy, full prefill (nats/token)", c.ce_full, handout=handout(HANDOUT, "city_ce_full", s)),
        fact("cross-entropy, full reuse (nats/token)", c.ce_reuse, handout=handout(HANDOUT, "city_ce_reuse", s)),
        fact("KL(full prefill || full reuse)", c.kl, fmt="{:.5f}", handout=handout(HANDOUT, "city_kl", s)),
        fact("true entropy of words 2-8 (nats/token)", c.entropy)], source="blend.city_reuse.city_losses",
                          notes=[city_note(c, s)]))
    add_json(page, {"city_ce_full": c.ce_full, "city_ce_reuse": c.ce_reuse, "city_kl": c.kl})


def city_note(c: city_reuse.City, s) -> str:
    """Where our cross-entropies sit against the language's own entropy and the handout's, and whether
    reuse equals prefill (KL under a thousandth)."""
    gap, ref = c.ce_full - c.entropy, handout(HANDOUT, "city_ce_full", s)
    sits = (f"sits {'on' if abs(gap) < 0.01 else f'{gap:+.4f} nats/token off'} its own language's entropy (ours "
            f"{c.ce_full:.4f} vs a true {c.entropy:.4f} nats/token")
    return (f"Our city language is not the handout's, so the cross-entropies differ: each model {sits}; the "
            f"handout's {ref.figure} is near ln 2 = {math.log(2):.4f}, one coin flip a word)" if isinstance(ref, Ref)
            else f"Our model {sits})") + (f". What carries over is reuse = prefill: KL {c.kl:.5f}." if c.kl < 1e-3
                                          else f". Reuse is not prefill: KL {c.kl:.5f}.")


# ============================================================================ the record world's model (§0.4)
def show_record_model(page: Page, t: rb.Training, s) -> None:
    """What the cache holds about the record model's training, and its training figure."""
    page.say(record_model_line(t, s))
    add_json(page, {"train_seconds": t.train_seconds, "drop_step": t.drop_step, "heldout_acc": t.heldout_acc})
    if page.plot:
        plot_training(t.meta, path := page.figure_path("04_record_world_training.png"))
        page.add_figure(path)


def record_model_line(t: rb.Training, s) -> str:
    """The record model in one line: loaded or trained here, its drop, held-out accuracy and locality penalty."""
    how = f"trained {t.steps} steps in {t.train_seconds:.0f} s"
    return ("\nrecord world model: " + (f"loaded from code/checkpoints/ ({how} when it was cached)" if t.loaded
                                         else how)
            + f", accuracy crossed 50% at step {t.drop_step} (handout: {handout_text(handout(HANDOUT, 'train', s))})"
            f"; held-out {t.heldout_acc:.2%} on {t.heldout_questions:,} questions; locality penalty {t.locality}"
            + (f" from step {t.locality_from_step}" if t.locality else ""))


# ============================================================================ §5.2-5.3 Part 2: records
LABELS = {"full": "full prefill", "reuse": "full reuse", "blend": "CacheBlend", "random": "random"}
SPLIT_REFS = {"full": "split_full", "reuse": "split_reuse", "random": "split_random"}   # blend: blend_c<chunk>


def records_json(run: rb.RecordRun) -> dict:
    """Part 2's keys: split-record accuracy of each method (CacheBlend and random named by their ratio),
    unsplit of full prefill and full reuse."""
    out = {"chunk_len": run.chunk_len, "ratio": run.ratio}
    for m in rb.METHODS:
        out[f"split_acc_{m if m in ('full', 'reuse') else m + pk(run.ratio)}"] = run.acc[m].split
    for m in ("full", "reuse"):
        out[f"unsplit_acc_{m}"] = run.acc[m].unsplit
    return out


def show_records(page: Page, run: rb.RecordRun, s) -> None:
    r, ids = f"{run.ratio:.0%}", run.split_ids
    page.part("Part 2", "§5.2, §5.3", "Record world: full reuse, CacheBlend and random picks of the same size")
    ref = {**SPLIT_REFS, "blend": f"blend_c{run.chunk_len}"}
    rows = [Row([LABELS[m] + (f" {r}" if m in ("blend", "random") else ""), run.acc[m].split, run.acc[m].unsplit,
                 handout_text(handout(HANDOUT, ref[m], s)),
                 handout_text(handout(HANDOUT, "unsplit_reuse", s) if m == "reuse" else None)]) for m in rb.METHODS]
    add_table(page, Table(title=f"Record world, chunks of {run.chunk_len}: split records {ids} (values at positions "
                          f"{[2 * i + 1 for i in ids]});\n{run.n_split:,} questions on split records, "
                          f"{run.n_unsplit:,} on unsplit; chance 1/{N_RECORDS} = {1 / N_RECORDS:.1%}.",
                          section="§5.2, §5.3",
                          cols=cols("method", ("split records", pct1), ("unsplit records", pct1),
                               "handout split", "handout unsplit"), rows=rows,
                          source="blend.record_blend.record_experiment",
                          notes=random_note(run, s)))
    add_json(page, records_json(run))


def random_note(run: rb.RecordRun, s) -> list[str]:
    """What random picks of r N tokens should repair if a pick helps only the record it touches."""
    rand, reuse, dev = (run.acc[m].split for m in ("random", "reuse", "blend"))
    if rand is None or reuse is None:
        return []
    r, guess, ref = f"{run.ratio:.0%}", run.ratio + (1 - run.ratio) * reuse, handout(HANDOUT, "split_random", s)
    touch = "about" if abs(rand - guess) < 0.1 else "more than" if rand > guess else "less than"
    return [f"random {r}: a split record is repaired when its value token is among the picks; if nothing else "
            f"helped, {r} + {1 - run.ratio:.0%} x {pct1(reuse)} (full reuse) = {pct1(guess)}. Ours: {pct1(rand)}, "
            f"{above(rand, guess)} that estimate" + (f"; the handout's {ref.figure} lies {above(number(ref), guess)}"
                                                    " it" if isinstance(ref, Ref) else "")
            + f". Random picks recover {touch} what they touch; deviation picks recover {pct1(dev)}."]


def show_input_rules(page: Page, run: rb.RecordRun, acc: dict, s) -> None:
    """Part 2's records under the rules that read the input first, beside CacheBlend's deviation picks."""
    r = f"{run.ratio:.0%}"
    rows = [Row([f"{LABELS['blend']} {r}", run.acc["blend"].split, run.acc["blend"].unsplit])]
    rows += [Row([f"{m} {r}", a.split, a.unsplit]) for m, a in acc.items()]
    rows.append(Row([f"{LABELS['random']} {r}", run.acc["random"].split, run.acc["random"].unsplit]))
    q = acc.get("query")
    add_table(page,
              Table(title=f"Record world, chunks of {run.chunk_len}, r = {r}: the rules that read the input before "
                          "blend() (blend_rules.INPUT_RULES);\n  query: the tokens the question's tokens attend to "
                          "most over full reuse's cache; query+dev: with layer 0's deviation; chunk-start: the\n  "
                          "first tokens of every chunk (EPIC)", section="§5.3",
                          cols=cols("method", ("split records", pct1), ("unsplit records", pct1)), rows=rows,
                          source="blend.record_blend.input_rules",
                          notes=[query_record_note(run, acc)] if q and q.split is not None else []))
    add_json(page, {"query_split_acc": q.split if q else None,
                    "input_rules_split_acc": {m: a.split for m, a in acc.items()}})


def query_record_note(run: rb.RecordRun, acc: dict) -> str:
    """Whether the question's attention alone repairs split records, and why not when it does not."""
    q, dev, rand = acc["query"].split, run.acc["blend"].split, run.acc["random"].split
    return (f"the question's attention alone repairs {pct1(q)} of split records against the deviation's {pct1(dev)}"
            + (" and random's " + pct1(rand) if rand is not None else "") + ": " + (
                "the questions ask for every record, so they read every value, stale or not: what the question "
                "reads does not say which of its tokens are stale; with layer 0's deviation beside it "
                f"{pct1(acc['query+dev'].split)}." if q < dev else "it finds the values the questions read."))


# ---------------------------------------------------------------------------- §5.2, exercise 6
def show_split_at(page: Page, e: rb.SplitAt, s) -> None:
    page.exercise(6, "§5.2", f"chunk length {e.chunk_len}: how many records are split, and full reuse's accuracy")
    add_table(page, Table(title="", section="§5.2", cols=cols("exercise 6", ("ours", pct1)), rows=[
        fact(f"records split by chunks of {e.chunk_len}", e.split_records, fmt=lambda x: f"{len(x)} {x}",
             handout=handout(HANDOUT, "ex6_split", s)),
        fact("full reuse: accuracy on every question", e.reuse_acc, handout=handout(HANDOUT, "ex6_reuse", s)),
        fact("full prefill: accuracy on every question",
             e.full_acc)], source="blend.record_blend.split_at", notes=[split_note(e)]))
    add_json(page, {"ex6": e})


def split_note(e: rb.SplitAt) -> str:
    """Why records are (or are not) split at this chunk length, and whether full reuse answers as full prefill."""
    bounds = range(e.chunk_len, DOC_LEN, e.chunk_len)
    where = ("every boundary falls on a key (an even position)" if all(b % 2 == 0 for b in bounds) else
             f"boundaries {list(bounds)} fall on values too")
    return (f"{where}, so no record is split" if not e.split_records else
            f"{where}: records {e.split_records} are split") + (
        f"; full reuse answers {'exactly as' if e.reuse_equals_full else 'NOT as'} full prefill does "
        f"({pct1(e.reuse_acc)} vs {pct1(e.full_acc)}).")


# ============================================================================ §5.3 Part 3: insights
def findings_json(p: rb.Findings, s) -> dict:
    """Part 3's keys: the insights, chunk length 3's CacheBlend at r, the curve (c<chunk>_deviation/_random)."""
    f, top, c = p.insights, pk(s.top_share), p.curve
    out = {"doc_attention_elsewhere": p.elsewhere, f"top{top}_deviation_share": f.top_share,
           f"top{top}_per_layer": f.top_per_layer, "adjacent_layer_rank_corr": f.rank_corr,
           "layer0_pick_coverage": f.layer0_coverage, f"chunk3_blend{pk(s.ratio)}": p.blend_at_ratio.get(3),
           "curve_ratios": c.ratios, "curve": {}}
    for n in c.blend:
        out["curve"][f"c{n}_deviation"], out["curve"][f"c{n}_random"] = c.blend[n], c.random[n]
    return out


def show_findings(page: Page, p: rb.Findings, s) -> None:
    f, L, r = p.insights, p.insights.deviation.shape[0], f"{s.ratio:.0%}"
    page.part("Part 3", "§5.3", "The two insights, and the compute-quality curve")
    rows = [fact(f"document tokens' attention on other tokens, layers 0-{L - 1}", p.elsewhere, fmt=pcts),
            fact(f"top {s.top_share:.0%} of tokens: share of KV deviation (layers 1-{L - 1})", f.top_share,
                 handout=handout(HANDOUT, "top_share", s)),
            fact(f"  per layer {', '.join(map(str, range(1, L)))}", f.top_per_layer, fmt=pcts),
            fact(f"rank correlation of deviation, layers {', '.join(f'{i}-{i + 1}' for i in range(1, L - 1))}",
                 f.rank_corr, fmt=lambda xs: " ".join(f"{x:.2f}" for x in xs),
                 handout=handout(HANDOUT, "rank_corr", s)),
            fact("  layer-0 attention dev. vs layer-1 KV dev.", f.layer0_vs_layer1, fmt="{:.2f}"),
            fact(f"layer-0 picks ({r}) covering chunk-initial values", f.layer0_coverage,
                 handout=handout(HANDOUT, "layer0_coverage", s)),
            fact(f"chunk-initial values' share of the deviation, layers 1-{L - 1}", f.first_value_share, fmt=pcts),
            *[fact(f"chunk length {n}: CacheBlend {r} on split records", acc,
                   handout=handout(HANDOUT, f"blend_c{n}", s, chunk_len=n)) for n, acc in p.blend_at_ratio.items()],
            fact(f"lowest ratio recovering >= {p.recover:.0%} of split records, chunk length "
                 + " / ".join(map(str, p.lowest)), " / ".join(pct1(x) for x in p.lowest.values()))]
    add_table(page,
              Table(title=f"chunks of {s.chunk_len}; deviation = precomputed chunks' KV minus full prefill's, per "
                          "layer", section="§5.3", cols=cols("insight", ("ours", pct1)), rows=rows,
                    source="blend.record_blend.insights"))
    c = p.curve
    add_table(page, Table(title="compute-quality curve: accuracy on split records", section="§5.3",
                          cols=cols(("ratio", "{:.0%}"), *[(f"c={n} {how}", pct1) for n in c.blend
                                                      for how in ("blend", "random")]),
                          rows=[Row([x] + [acc[i] for n in c.blend for acc in (c.blend[n], c.random[n])])
                           for i, x in enumerate(c.ratios)], source="blend.record_blend.curve"))
    curve_figure(page, c, s)
    concentration_figure(page, f.deviation, s)
    add_json(page, findings_json(p, s))


def curve_figure(page: Page, c: rb.Curve, s) -> None:
    x, color = [100 * r for r in c.ratios], {3: "tab:purple", 5: "tab:blue"}
    lines = [Series(x, [None if a is None else 100 * a for a in accs], f"chunk length {n}, {how}",
                    style=dict(marker=mark, ls=ls, color=color.get(n, "gray")))
             for n in c.blend for how, accs, mark, ls in (("CacheBlend (deviation)", c.blend[n], "o", "-"),
                                                          ("random tokens", c.random[n], "x", "--"))]
    floor = dict(color="gray", ls="-.", lw=0.8, label=f"the controller's floor, --min-ratio {s.min_ratio:.0%} "
                                                       "(§5.4)")
    chart_figure(page, "04_compute_quality.png", Chart(
        series=lines, xlabel="recompute ratio r (% of context tokens)", ylabel="accuracy on split records (%)",
        legend=dict(loc="lower right"), hlines=[(100 / N_RECORDS, {**REFERENCE, "label": f"chance (1/{N_RECORDS})"})],
        vlines=[(100 * s.min_ratio, floor)]), "compute vs quality: recomputing the right tokens", figsize=(6.4, 4))


def concentration_figure(page: Page, dev, s) -> None:
    """Per layer: share of the KV deviation held by the top x% of tokens (a Lorenz-style curve)."""
    ref, x = handout(HANDOUT, "top_share", s), [100 * k / dev.shape[2] for k in range(dev.shape[2] + 1)]
    lines = [Series(x, (100 * rb.lorenz(dev[i])).tolist(), f"layer {i}", style=dict(marker="."))
             for i in range(1, dev.shape[0])]
    chart_figure(page, "04_deviation_concentration.png", Chart(
        series=lines + [Series([0, 100], [0, 100], "evenly spread", style=REFERENCE)],
        xlabel="top x% of context tokens (by KV deviation)", ylabel="% of the layer's KV deviation",
        vlines=[(100 * s.top_share, dict(color="gray", ls="--", lw=0.8))]), "How concentrated is full reuse's KV "
        f"deviation?\n(chunks of {s.chunk_len}"
        + (f"; handout: top {s.top_share:.0%} hold {ref.figure})" if isinstance(ref, Ref) else ")"),
        figsize=(6.4, 4.4))


# ---------------------------------------------------------------------------- §5.3, the mask pitfall
def why_the_mask_is_wrong(future: float, picks: int, n_context: int) -> str:
    """The pitfall in one line, with what the mask did to this run's picks."""
    return (f"Why it is wrong: the bottom-right mask lets the i-th of the m recomputed tokens see keys up to "
            f"N - m + i, as if the picks were the last m tokens; this run's {picks} picks at layer 1 each see "
            f"{future:.1f} later tokens of the {n_context} on average, a future no prefill shows (LMCache#1152, "
            "CacheBlend#21).")


def show_mask(page: Page, c: mp.MaskCost, s) -> None:
    """CacheBlend with the position mask against the released blenders' bottom-right mask."""
    if c.split["position"] is None:
        page.say(f"  The mask pitfall (§5.3): chunks of {s.chunk_len} split no record, so there is nothing for "
                 "either mask to repair here.")
        return
    add_table(page,
              Table(title=f"Pitfall: the causal mask of the recomputed tokens. CacheBlend {s.ratio:.0%}, chunks of "
                          f"{s.chunk_len}", section="§5.3", cols=cols("mask at layers 1..L-1", ("split records", pct1),
                                                         ("unsplit records", pct1)), rows=[
        Row(["position mask (blend's): each row sees the keys up to its own position",
             c.split["position"], c.unsplit["position"]]),
        Row(["bottom-right mask (the pitfall): the rows taken as the last ones",
             c.split["bottom-right"], c.unsplit["bottom-right"]])],
        source="blend.mask_pitfall.record_cost", notes=[why_the_mask_is_wrong(c.future_keys, c.picks, DOC_LEN),
                                                  mask_cost_note(c)]))
    add_json(page, {"mask_position_split_acc": c.split["position"], "mask_pitfall_split_acc": c.split["bottom-right"]})


def mask_cost_note(c: mp.MaskCost) -> str:
    """What the bottom-right mask costs the split records here, and why it can cost nothing in this model."""
    diff = c.split["position"] - c.split["bottom-right"]
    cost = (f"Here it costs {diff:.1%} of the split records" if diff > 0 else
            "Here it costs nothing" if diff == 0 else f"Here it gains {-diff:.1%} of the split records")
    return cost + (f": the answers read the context's KV of layers 0-{c.layers_read - 1} only (full reuse's above "
                   f"them answers as well), and the first K, V a mask can change are layer {mp.FIRST_LAYER_CHANGED}'s; "
                   "--model smollm2 measures the pitfall on a real LLaMA." if c.layers_read <= mp.FIRST_LAYER_CHANGED
                   else ".")


# ---------------------------------------------------------------------------- §5.3, exercise 7
def show_check_cost(page: Page, ex: list[bt.CheckCost], rho: float, s) -> None:
    """Exercise 7: the check at layer 0 vs layer 1 on every system; rho: layer 0's rank correlation with 1."""
    page.exercise(7, "§5.3", f"the cost of CacheBlend's check at layer 0 vs layer 1 ({ex[0].n_ctx:,} context "
                             f"tokens, {s.gpu}, time model)")
    rows = [Row([f"{tm.get_model(e.model).name}, at layer {i}", gflop, ms, e.full_layer_ms])
            for e in ex for i, gflop, ms in ((0, e.layer0_gflop, e.layer0_ms), (1, e.layer1_gflop, e.layer1_ms))]
    add_table(page, Table(title="", section="§5.3", cols=cols("check of the deviation (all tokens)", ("GFLOP",
                                                                                                      "{:.0f}"),
                                           ("ms", "{:.1f}"), ("one full layer, ms", "{:.1f}")),
                          rows=rows, source="blend.timing.check_cost",
                          notes=[check_note(ex, rho)]))
    add_json(page, {"ex7": ex})


def check_note(ex: list[bt.CheckCost], rho: float) -> str:
    """Why CacheBlend checks at layer 0 (its K, V exact, one attention pass) and not at layer 1, from the costs;
    how layer 0's deviation ranks against layer 1's (rank correlation rho)."""
    return ("Layer 0's K, V depend only on token and position, so the precomputed ones are exact: one more attention "
            "pass over them (all keys instead of the chunk's) gives the deviation, at most "
            f"{max(e.layer0_ms / e.full_layer_ms for e in ex):.0%} of a layer here. Layer 1's true K, V need layer "
            "0's output for every token, a whole layer of prefill"
            + (" (with the check, more than a layer here)" if all(e.layer1_ms > e.full_layer_ms for e in ex) else "")
            + ": at layer 1 and above CacheBlend can afford to recompute only the tokens it picked. Ours: layer-0 "
            "attention deviation ranks " + ("like" if rho >= 0.8 else "roughly like" if rho >= 0.5 else "unlike")
            + f" layer-1 KV deviation (rank correlation {rho:.2f}).")


# ============================================================================ §5.4 Part 4: timing
def show_pipelining(page: Page, timings: dict[str, bt.SystemTiming], s, waits: list | None = None) -> None:
    page.part("Part 4", "§5.4", f"Hiding recompute behind loading ({s.gpu}, time model)")
    for model, t in timings.items():
        rows = [Row([label, ms, None, None, None, None]) for label, ms in (
            ("full recompute of the layer", t.full_layer_ms), (f"recompute {s.min_ratio:.0%}", t.floor_layer_ms))]
        rows += [Row([f"load from {d}", x.load_ms, x.ratio, 1e3 * x.ttft_s, x.speedup, x.choice])
                 for d, x in t.devices.items()]
        add_table(page, Table(title=f"{tm.get_model(model).name} ({t.tag}) on {t.n_gpus} x {s.gpu}: {s.rag_chunks} x "
                              f"{s.rag_chunk_tokens} tokens + {s.rag_question}-token question; full prefill TTFT "
                              f"{1e3 * t.prefill_s:.0f} ms", section="§5.4",
                              cols=cols("per layer", ("ms", "{:.1f}"), ("controller ratio", "{:.0%}"),
                                   ("TTFT CacheBlend (ms)", "{:.0f}"), ("vs full prefill", "{:.2f}x"),
                                   Col("controller's choice",
                                       left=True)), rows=rows, source="blend.timing.system_timing",
                              notes=[f"{d}: {x.reason}." for d, x in t.devices.items() if x.choice != lc.BLEND]))
    show_comparison(page, timings, s)
    show_throughput(page, timings, s)
    if waits:
        show_query_wait(page, waits, s)
    timing_figure(page, timings, s)
    t70 = timings.get("llama-3.1-70b")
    add_json(page, {"timing": timings,
                    "llama70b_nvme_vs_recompute": t70.devices[s.paper_device].load_vs_full if t70 else None})


def show_query_wait(page: Page, waits: list, s) -> None:
    """A query rule on the time model: ranking by the question's attention at layers 1..j waits for layers
    0..j's KV; per system, the pipelined TTFT over j beside blend's."""
    for w in waits:
        rows = [Row(["no ranking pass (blend)", 1e3 * w.plain_s, 1.0, w.prefill_s / w.plain_s])]
        rows += [Row([f"layers 1..{j}" + (" (all)" if j == w.n_layers - 1 else ""), 1e3 * t, t / w.plain_s,
                      w.prefill_s / t]) for j, t in zip(w.depths, w.ttft_s)]
        add_table(page,
                  Table(title=f"{tm.get_model(w.model).name} on {w.n_gpus} x {s.gpu}, KV on {w.device}: a query rule "
                              f"at the controller's {w.ratio:.0%} (per layer: load {w.load_ms:.1f} ms, recompute "
                              f"{w.recompute_ms:.1f} ms,\n  the question's pass {w.pass_ms:.2f} ms); the ranking "
                              "needs layers 0..j's KV before any layer recomputes", section="§5.4",
                              cols=cols("ranking reads", ("TTFT (ms)", "{:.0f}"), ("vs blend", "{:.2f}x"),
                                   ("vs full prefill", "{:.2f}x")), rows=rows, source="blend.timing.query_wait",
                              notes=[query_wait_note(w)]))
    add_json(page, {"timing_query_wait": {w.model: {"depths": w.depths, "ttft_s": w.ttft_s, "blend_s": w.plain_s,
                                                    "device": w.device} for w in waits}})


def query_wait_note(w: bt.QueryWait) -> str:
    """How much of the pipeline's overlap ranking by all layers gives up, from the rows."""
    last = w.ttft_s[-1]
    return (f"ranking by every layer ({w.depths[-1]}) costs {last / w.plain_s:.2f}x blend's pipelined TTFT "
            f"({1e3 * last:.0f} ms against {1e3 * w.plain_s:.0f} ms): every layer's KV is read before the first "
            f"recompute; by layers 1..{w.depths[0]}, {w.ttft_s[0] / w.plain_s:.2f}x" + (
                f"; it is still faster than a full prefill ({1e3 * w.prefill_s:.0f} ms)." if last < w.prefill_s else
                f"; slower than a full prefill ({1e3 * w.prefill_s:.0f} ms)."))


def show_comparison(page: Page, timings: dict[str, bt.SystemTiming], s) -> None:
    dev, rows = s.paper_device, []
    for model, t in timings.items():
        name, ref = tm.get_model(model).name, lambda x: handout(HANDOUT, f"{x} {model}", s, system=(model, t.n_gpus))
        rows += [fact(f"{name}: full recompute / {dev} load per layer", t.devices[dev].load_vs_full, fmt="{:.3g}x",
                      handout=ref("nvme_vs_recompute")),
                 fact(f"paper point, {name}, {s.paper_context} tokens: {s.paper_ratio:.0%} recompute per layer (ms)",
                      t.paper.recompute_ms, handout=ref("paper_recompute")),
                 fact(f"paper point, {name}: {dev} read per layer (ms)", t.paper.load_ms, handout=ref("paper_load"))]
    rows.append(fact(f"TTFT speed-up over full prefill ({dev}, {' / '.join(tm.get_model(m).name for m in timings)})",
                     " / ".join(f"{t.devices[dev].speedup:.1f}x" for t in timings.values()),
                     handout=handout(HANDOUT, "ttft_speedup", s)))
    add_table(page, Table(title=f"Load vs recompute ({s.gpu}; paper points on the same GPU)", section="§5.4",
                          cols=cols("comparison", ("ours", "{:.1f}")), rows=rows, source="blend.timing.system_timing",
                          notes=speedup_notes(timings, s)))


def speedup_notes(timings: dict[str, bt.SystemTiming], s) -> list[str]:
    """Why the time model's speed-ups and load/recompute ratios differ from the paper's, from the rows."""
    nvme, ref = {m: t.devices[s.paper_device] for m, t in timings.items()}, handout(HANDOUT, "ttft_speedup", s)
    held = isinstance(ref, Ref)
    lo, hi = (float(x.strip("x")) for x in ref.figure.split("-")) if held else (0.0, 0.0)
    outside = held and not any(lo <= d.speedup <= hi for d in nvme.values())
    notes = [(f"Why our speed-ups are not the paper's {ref.figure}: " if outside else "Our speed-ups: ")
             + "the controller sets recompute = load, so " + " and ".join(
                 f"{tm.get_model(m).name} recomputes {d.ratio:.0%} of every layer (speed-up about 1/{d.ratio:.2f} = "
                 f"{1 / d.ratio:.1f}x)" for m, d in nvme.items()) + f"; the floor is {s.min_ratio:.0%}."
             + (" The paper's are measured end to end in vLLM (kernels, scheduling, real disks), ours are a roofline "
                "with no overheads." if held else "")]
    t = timings.get("llama-3.1-70b")
    ref70 = t and handout(HANDOUT, "nvme_vs_recompute llama-3.1-70b", s, system=("llama-3.1-70b", t.n_gpus))
    if isinstance(ref70, Ref):
        implied = t.paper.recompute_ms / s.paper_ratio / t.paper.load_ms
        notes.append(f"Full recompute / {s.paper_device} load for LLaMA-3.1-70B is "
                     f"{nvme['llama-3.1-70b'].load_vs_full:.1f}x here; the paper's own per-layer points (the rows "
                     f"above) imply {t.paper.recompute_ms:.1f} / {s.paper_ratio:.2f} / {t.paper.load_ms:.1f} = "
                     f"{implied:.1f}x at {s.paper_context} tokens, so the "
                     f"handout's {ref70.figure} " + ("follows from them." if abs(implied / number(ref70) - 1) < 0.2
                                                    else "does not follow from them."))
    return notes


def show_throughput(page: Page, timings: dict[str, bt.SystemTiming], s) -> None:
    """§5.4's throughput headline: requests/s of full prefill vs CacheBlend, one server kept busy."""
    rows = [Row([f"{tm.get_model(m).name}, {s.paper_device}, recompute {r:.0%}", x.full_rps, x.blend_rps, x.bound,
                 x.blend_rps / x.full_rps], handout(HANDOUT, "throughput", s)) for m, t in timings.items()
            for r, x in t.throughput.items()]
    add_table(page, Table(title=f"Throughput of one server kept busy by RAG requests ({s.gpu})", section="§5.4",
                          cols=cols("throughput (requests/s)", ("full prefill", "{:.2f}"), ("CacheBlend", "{:.2f}"),
                               "bound by", ("ratio", "{:.1f}x")), rows=rows, source="blend.timing.throughput",
                          notes=[throughput_note(timings, s)]))


def floor_serves_most(timings: dict[str, bt.SystemTiming], min_ratio: float) -> bool:
    """Does the floor ratio give the most requests/s on every system?"""
    return all(max(t.throughput, key=lambda r: t.throughput[r].blend_rps) == min_ratio for t in timings.values())


def throughput_note(timings: dict[str, bt.SystemTiming], s) -> str:
    """Why a busy server's requests/s differ from the latency choice; whether the floor serves the most."""
    return ("A busy server's GPUs do only the recompute and the question per request; loading the KV overlaps other "
            "requests' compute, until the device's bandwidth runs out. The controller's ratio (recompute = load) is "
            f"the latency choice; the {s.min_ratio:.0%} floor " + (
                "is what throughput wants." if floor_serves_most(timings, s.min_ratio) else
                "does not serve the most requests/s here."))


def timing_figure(page: Page, timings: dict[str, bt.SystemTiming], s) -> None:
    colors = lambda t: ["tab:red", "tab:orange"] + ["tab:blue"] * len(t.devices)  # noqa: E731
    panels = [Chart(series=[Series(["full recompute",
                                    f"{s.min_ratio:.0%} recompute"] + [f"load: {d}" for d in t.devices],
                            [t.full_layer_ms, t.floor_layer_ms] + [x.load_ms for x in t.devices.values()], kind="barh",
                            style={"color": colors(t)}, fmt=" {:.1f} ms")],
                    xlabel="ms per layer (log scale)",
                    title=f"{tm.get_model(model).name} ({t.tag}), {t.n_gpus} x {s.gpu}",
                    xscale="log", legend=None) for model, t in timings.items()]
    chart_figure(page, "04_load_vs_recompute.png", panels, f"one layer of a {s.rag_chunks} x {s.rag_chunk_tokens}"
                 "-token RAG context: recompute vs load", figsize=(5 * len(panels), 3.8))


def show_one_gpu(page: Page, rows: list[bt.OneGpuRow], s) -> None:
    """Part 4 on one GPU: the time model beside a real GPU's measurement of the same quantities (a reference
    column, blank where the run's GPU row or floor ratio are not the ones measured, or the row was not run)."""
    g = tm.GPUS[s.check_gpu]
    ms = lambda x: f"{x:,.0f}" if x >= 100 else f"{x:.1f}" if x >= 10 else f"{x:.2f}"  # noqa: E731
    add_table(page, Table(
        title=f"The same on one {s.check_gpu} ({g.bf16_flops / 1e12:,.0f} TFLOP/s BF16, host link {g.pcie_bw / 1e9:g} "
              f"GB/s), the KV in pinned CPU memory: the time model beside a measurement", section="§5.4",
        cols=[Col("one GPU", left=True), Col(f"time model, {s.check_gpu} (ms)", ms, "one_gpu_timemodel_s.{row}", 1e-3),
              Col(gr.H200.label, left=True, reference=True)],
        rows=[Row([r.label, 1e3 * r.model_s, handout_text(handout(MEASURED, r.key, s))], key=r.key) for r in rows],
        source="blend.timing.one_gpu", notes=[one_gpu_note(rows, s)]))


def one_gpu_note(rows: list[bt.OneGpuRow], s) -> str:
    """What the time model says of the recompute's share of a layer and of the pipeline's saving, from the rows."""
    by = {r.key: r.model_s for r in rows}
    shares = sorted({round(by[k] / by[k.replace("recompute", "layer", 1)], 3) for k in by if k.startswith("recompute")})
    saved = [1 - by[k] / by[k.replace("pipelined", "serial")] for k in by if k.endswith("pipelined")]
    return (f"On the time model a {s.min_ratio:.0%} recompute costs {shares[0]:.0%}"
            + (f"-{shares[-1]:.0%}" if f"{shares[-1]:.0%}" != f"{shares[0]:.0%}" else "")
            + f" of the layer (the FLOPs' share), and the second stream saves {min(saved):.0%}-{max(saved):.0%} of "
            "the serial time. gpu_check.py measures the same on your GPU.")


# ---------------------------------------------------------------------------- §5.4, exercise 8
def show_controller(page: Page, c: lc.Choice, s) -> None:
    page.exercise(8, "§5.4", f"{s.layers} layers, read {s.read_ms:g} ms/layer, prefill {s.prefill_ms:g} ms/layer, "
                             f"floor {s.min_ratio:.0%}")
    rows = [fact("controller's choice", c.choice, handout=handout(HANDOUT, "ex8_choice", s)),
            fact("controller's recompute ratio", c.ratio, fmt="{:.0%}", handout=handout(HANDOUT, "ex8_ratio", s)),
            fact(f"TTFT, {'CacheBlend pipelined' if c.choice == lc.BLEND else 'the full prefill chosen'} (ms)",
                 1e3 * c.ttft_s, handout=handout(HANDOUT, "ex8_ttft_ms", s))]
    if c.choice != lc.BLEND:
        rows.append(fact(f"  blending from the SSD anyway, at {c.stored_ratio:.0%} (ms)", 1e3 * c.stored_ttft_s))
    rows.append(fact("TTFT, full prefill (ms)", 1e3 * c.full_s, handout=handout(HANDOUT, "ex8_full_ms", s)))
    add_table(page, Table(title="", section="§5.4", cols=cols("exercise 8", ("ours", "{:.0f}")), rows=rows,
                          source="loading_controller.choose",
                          notes=[c.reason[0].upper() + c.reason[1:] + "."]))
    add_json(page, {"ex8_choice": c.choice, "ex8_ratio": c.ratio, "ex8_ttft_ms": 1e3 * c.ttft_s,
                    "ex8_full_ms": 1e3 * c.full_s})
