"""03's Part over a real connection (handout §4.2 on this machine, as CacheGen's evaluation streams real
bitstreams over a shaped link): SmolLM2's KV of a context, coded at the levels measured on SmolLM2 (Part
2c's codec, fitted as codec/smollm2.py fits it, given by 03), streamed through wire.py's paced socket on several
traces by each policy, and beside each run the simulator fed this CPU's measured recompute and decode times
(compare.compare); then a run whose sender is killed mid-stream. Nothing here prints; 03's page
(stream/wire_page.py's show_wire) shows it.

The codec's levels are fitted once (codec.smollm2.real_codec_specs, cached: a codec is no timing);
every time is measured in the run that prints it. The context is a RAG item of common/english.py (its key
passages, then its distractors, then calibration prose to fill it), read as one prompt in SmolLM2's chat
format; the question follows it, and the greedy answer of a full prefill is the reference every run's answer
is checked against. Everything runs on one torch thread (common.llama.single_thread): the compute thread,
the link thread and the sender process share this CPU's cores, and a torch thread waiting for a busy core
stalls every step.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import threading
import time
from dataclasses import dataclass

from lecture27 import kvcache as kv
from lecture27 import streaming as st
from lecture27 import wire
from lecture27.stream import answer
from lecture27.stream import compare
from lecture27.stream import measure
from lecture27.stream import wire_runs

POLICIES = ("adaptive", *(f"level{i}" for i in range(kv.N_LEVELS)), "text")
KILL_TRACE = "handout"     # the kill-the-sender run: this trace (every study has it), the adaptive policy, the
KILL_CHUNK = 1             # sender dying inside this chunk's transfer (at the choices the trace's adaptive run made)
LAYOUT_TRACE = "handout"   # each level's stream layout is chosen at this trace's mean rate over the SLO window
                           # (03's --trace FILE replaces it): one sender holds one set of bitstreams for every trace


@dataclass(frozen=True, kw_only=True)
class WireStudy:
    """The Part's runs. traces: name -> the trace the socket was paced to (bandwidths divided by `scale`);
    runs: trace -> policy -> compare.Compared; kill: the kill-the-sender run (wire_runs.WireRun), its sender
    told to die once it had sent kill_after_bytes; the measured inputs the simulator was fed."""
    scale: float
    kv_ratio: float            # wire.wire_scale(): the lecture model's FP16 KV bytes per token over SmolLM2's
    context_tokens: int
    chunk_tokens: int
    slo_s: float
    layouts: dict              # level name -> measure.LayoutChoice: its bitstreams' layout, chosen at layout_gbps
    layout_gbps: float         # Gb/s (scaled): LAYOUT_TRACE's mean rate over the SLO window (window_gbps)
    options: tuple             # streaming.Option per level (bits per token as coded here), then text
    recompute_s: tuple         # measured seconds per chunk
    decode_s: dict             # level -> measured seconds per chunk
    traces: dict
    runs: dict
    kill: wire_runs.WireRun
    kill_after_bytes: int
    question: str              # the question, as text
    answer: str                # the full prefill's greedy answer, as text
    answer_tokens: int         # ... its tokens
    answers_computed: int      # distinct KVs whose answer was computed (AnswerCheck); the other runs' KV equals one
    answers_reused: int
    answers_s: float           # wall seconds: answering
    prepare_s: float           # wall seconds: measuring the context (measure.prepare)
    seconds: float             # wall seconds: the whole study (wire_study(): the model's loading included)

    @property
    def bytes_equal(self) -> bool:
        """Every chunk received, in every run, byte for byte the one the sender holds."""
        return all(c.bytes_equal for by in self.runs.values() for c in by.values()) and self.kill.bytes_equal

    @property
    def kill_ok(self) -> bool:
        """The killed sender was noticed, every chunk from the lost one on was recomputed, and the answer is
        the full prefill's."""
        lost = next((i for i, r in enumerate(self.kill.rows) if r.lost is not None), None)
        return (self.kill.fell_back and lost is not None and self.kill.same_answer
                and all(c == "text" for c in self.kill.choices[lost:]))

    @property
    def first_token_kl(self) -> float:
        """The largest first-token KL to the full prefill over every run."""
        return max([c.first_token_kl for by in self.runs.values() for c in by.values()] + [self.kill.first_token_kl])

    @property
    def pacing(self) -> tuple[float, float, int]:
        """How close the measured pacing came to the token bucket's plan: (the sender's last write after its
        plan, mean seconds over every transfer; a KV chunk's transfer, request to last byte, mean seconds;
        transfers)."""
        runs = [c for by in self.runs.values() for c in by.values()]
        n = sum(a is not None for c in runs for a, *_ in c.measured_spans)
        kv_transfers = [b - a for c in runs for (a, b, *_), ch in zip(c.measured_spans, c.measured_choices)
                        if a is not None and ch != "text"]
        return (sum(c.parts_s["pacing granularity"] for c in runs) / max(n, 1),
                sum(kv_transfers) / max(len(kv_transfers), 1), n)

    @property
    def slowdown(self) -> dict:
        """{"decode", "recompute"}: the seconds a chunk's decode (KV) or recompute (text) took in the runs over
        the seconds the simulator was fed (measured alone, before the runs), summed over every run's chunks: the
        compute thread shares the CPU with the link thread and the sender."""
        out = {}
        for what, is_text in (("decode", False), ("recompute", True)):
            pairs = [(m[3] - m[2], s[3] - s[2]) for by in self.runs.values() for c in by.values()
                     for m, s, ch in zip(c.measured_spans, c.simulated_spans, c.measured_choices)
                     if (ch == "text") == is_text and c.measured_choices == c.simulated_choices]
            out[what] = sum(m for m, _ in pairs) / sum(s for _, s in pairs) if pairs else math.nan
        return out

    def json(self) -> dict:
        return {"wire_scale": self.scale,
                "wire_runs": {t: {p: c.entry() for p, c in by.items()} for t, by in self.runs.items()},
                "wire_layouts": {name: c.json() for name, c in self.layouts.items()},
                "wire_bytes_equal": self.bytes_equal, "wire_kill_fallback_ok": self.kill_ok,
                "wire_first_token_kl": self.first_token_kl}


def window_gbps(trace, seconds: float) -> float:
    """The link's mean rate over [0, seconds] (Gb/s): the bits it can carry by then over the seconds. Over the SLO
    window it is the rate a whole context sees when its transfer has to fit in the SLO, the rate its bitstreams'
    layout is chosen at (a rate at one moment would choose for a burst or a stall the context may never meet)."""
    return trace.bits_by(seconds) / seconds / st.GBIT


def context_of(tok, item, context_tokens: int) -> tuple[list, list]:
    """(context ids, question ids): the chat prefix, the item's key passages and distractors, calibration
    prose after them (again from its start when a context is longer than all of it), cut to context_tokens;
    then the item's question (common.english.question_text)."""
    from common.english import CALIBRATION, CHAT_PREFIX, question_text
    text = CHAT_PREFIX + "\n\n".join(item.key_passages + item.distractors)
    filler = itertools.cycle(CALIBRATION)
    while len(ids := tok.encode(text + "\n\n").ids) < context_tokens:
        text += "\n\n" + next(filler)
    return ids[:context_tokens], tok.encode(question_text(item)).ids


def wire_study(specs, traces: dict, context_tokens: int, chunk_tokens: int, scale: float, slo_s: float,
               accuracy: dict | None = None, answer_tokens: int = answer.ANSWER_TOKENS, item: int = 0,
               policies=POLICIES, gguf=None) -> WireStudy:
    """study_of() on SmolLM2 (or the GGUF at `gguf`) with `specs`, its codec's levels finest first (as
    codec.smollm2.real_codec_specs fits them), on the context of RAG item `item` (context_of). The study's
    seconds count the model's loading."""
    from common.english import RAG_ITEMS
    from common.gguf_llama import gguf_file, load_gguf_llama
    t0 = time.perf_counter()
    path = gguf_file(gguf)
    tables = threading.Thread(target=measure.build_decoders, args=(specs,), daemon=True)
    tables.start()                 # numpy builds the decoder tables while torch loads the weights
    try:
        model, tok, _ = load_gguf_llama(path)
    finally:
        tables.join()
    ids, question = context_of(tok, RAG_ITEMS[item], context_tokens)
    r = study_of(model, ids, question, specs, traces, chunk_tokens, scale, slo_s, accuracy,
                 answer_tokens, policies, lambda x: tok.decode(list(x)), keep_streams=True)
    return dataclasses.replace(r, question=RAG_ITEMS[item].question, seconds=time.perf_counter() - t0)


def study_of(model, ids, question, specs, traces: dict, chunk_tokens: int, scale: float, slo_s: float,
             accuracy: dict | None = None, answer_tokens: int = answer.ANSWER_TOKENS, policies=POLICIES,
             words=lambda x: " ".join(map(str, x)), keep_streams: bool = False) -> WireStudy:
    """Every trace (name -> trace at the lecture's bandwidths, divided by `scale` here) x policy streamed over
    one sender, the context measured first on this CPU (measure.prepare, each level's bitstreams in the layout
    measure.choose_layouts picks at LAYOUT_TRACE's scaled rate over the SLO window), then the kill-the-sender
    run on KILL_TRACE. accuracy: level -> the quality a chunk at that level counts for; words: token ids ->
    text; keep_streams: as prepare takes it."""
    from common.llama import single_thread
    t0 = time.perf_counter()
    scaled = {name: wire.scaled(tr, scale) for name, tr in traces.items()}
    layout_gbps = window_gbps(scaled[LAYOUT_TRACE], slo_s)
    layouts = measure.choose_layouts(specs, chunk_tokens, layout_gbps)
    with single_thread():
        prep = measure.prepare(model, ids, question, chunk_tokens, specs, accuracy, answer_tokens,
                               {name: c.layout for name, c in layouts.items()}, keep_streams=keep_streams)
        prepare_s = time.perf_counter() - t0
        check = answer.AnswerCheck(prep, model)
        runs = {name: {} for name in scaled}
        with contextlib.ExitStack() as wires:
            w = None
            for name, tr in scaled.items():
                for p in policies:
                    if w is None or w.broken:        # a run that lost its sender leaves the next one a new one
                        w = wires.enter_context(wire.Wire(tr, prep.payloads))
                    runs[name][p] = compare.compare(prep, model, tr, p, slo_s, w, check)
        kill_after = kill_bytes(prep, runs[KILL_TRACE]["adaptive"].measured_choices)
        kill = wire_runs.run(prep, model, scaled[KILL_TRACE], "adaptive", slo_s,
                             faults=wire.Faults(die_after_bytes=kill_after), check=check)
    return WireStudy(scale=scale, kv_ratio=wire.wire_scale(model.cfg.kv_bytes_per_token()), context_tokens=len(ids),
                     chunk_tokens=chunk_tokens, slo_s=slo_s, layouts=layouts, layout_gbps=layout_gbps,
                     options=prep.options,
                     recompute_s=prep.recompute_s, decode_s=prep.decode_s, traces=scaled, runs=runs, kill=kill,
                     kill_after_bytes=kill_after, question=words(question), answer=words(prep.ref_answer),
                     answer_tokens=len(prep.ref_answer), answers_computed=check.computed,
                     answers_reused=check.reused, answers_s=check.seconds, prepare_s=prepare_s,
                     seconds=time.perf_counter() - t0)


def kill_bytes(prep: measure.Prepared, choices: list) -> int:
    """The payload bytes after which the sender dies: the chunks before KILL_CHUNK and half of that one, at
    `choices`."""
    sizes = [len(prep.payloads[c][i]) for i, c in enumerate(choices)]
    return sum(sizes[:KILL_CHUNK]) + sizes[KILL_CHUNK] // 2 + 1

