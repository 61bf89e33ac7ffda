"""A context measured once on this CPU, before it is streamed over the wire (handout §4.2 on this machine):
each chunk's recompute (the model's prefill of that chunk after the exact KV of the chunks before it), its
bitstream at every codec level (the sender's payloads, each level in the stream layout choose_layouts picks
for the link) and each bitstream's decode (put after the KV before it, as a run does), and the full prefill's
answer (the first token's distribution, the greedy tokens). simulated.measured_setup turns those times into
the simulator's streaming.Setup.

The stream layout (kvcache.STREAM_LAYOUTS: how each group of tokens is cut into independent streams) trades
bytes on the link for decode time: one stream per (layer, K/V, channel) adds a length and an end to each of
thousands of streams, and decodes them side by side, ten times faster than one stream per group. Which pays
depends on the link: choose_layouts takes each level's layout whose chunk crosses the link and decodes
soonest (kvcache.stream_plan by time).
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from lecture27 import kvcache as kv
from lecture27 import kvstore
from lecture27 import streaming as st
from lecture27.stream import answer
from lecture27.stream import chunk_kv
from common.llama import kv_to_array


@dataclass(frozen=True, kw_only=True)
class LayoutChoice:
    """One level's stream layout for chunks of chunk_tokens tokens read over a link at gbps, and why: per layout,
    a chunk's expected bitstream bytes (kvcache.context_bytes), its streams, and its decode seconds on this
    machine (kvstore.layout_decode_s); the layout is the one whose bytes over the link plus decode take least."""
    layout: str
    gbps: float               # the link's rate it was chosen at, Gb/s (a trace's unit: 1e9 bits/s)
    chunk_tokens: int
    bytes: dict               # layout -> a chunk's expected bytes
    streams: dict             # layout -> a chunk's streams
    decode_s: dict            # layout -> a chunk's decode seconds
    bytes_only: str           # the codec's choice without a bandwidth (kvcache.stream_plan's bytes-only rule)

    def link_s(self, layout: str) -> float:
        return 8 * self.bytes[layout] / (self.gbps * st.GBIT)

    def seconds(self, layout: str) -> float:
        """A chunk in `layout`: its bytes over the link, then its decode."""
        return self.link_s(layout) + self.decode_s[layout]

    @property
    def runner_up(self) -> str:
        """The layout that would take the least time after the chosen one."""
        return min((x for x in self.bytes if x != self.layout), key=self.seconds)

    def best_at(self, gbps: float) -> str:
        """The layout with the least time on a link at `gbps` (Gb/s): at self.gbps, the chosen one."""
        return min(self.bytes, key=dataclasses.replace(self, gbps=gbps).seconds)

    def breakeven_gbps(self, other: str) -> float:
        """The link rate (Gb/s) at which `other` takes as long as the chosen layout: the chosen one is sooner
        above it when it has the more bytes, below it when it has the fewer (inf: never, it has the fewer bytes
        and decodes faster)."""
        dbytes, ddecode = self.bytes[self.layout] - self.bytes[other], self.decode_s[other] - self.decode_s[self.layout]
        return 8 * dbytes / ddecode / st.GBIT if dbytes * ddecode > 0 else math.inf

    def json(self) -> dict:
        return {"layout": self.layout, "gbps": self.gbps, "chunk_tokens": self.chunk_tokens, "bytes": self.bytes,
                "decode_s": self.decode_s, "seconds": {x: self.seconds(x) for x in self.bytes},
                "bytes_only": self.bytes_only}


def choose_layouts(specs, chunk_tokens: int, gbps: float) -> dict:
    """Level name -> LayoutChoice: each level's stream layout for chunks of chunk_tokens tokens read over a link
    at `gbps` (Gb/s), by time (kvcache.stream_plan with each layout's decode of such a chunk timed once on this
    machine, kvstore.layout_decode_s). Each level apart: its bytes, and so what the extra streams cost in link
    time against what they save in decode time, differ."""
    out = {}
    for spec in specs:
        decode_s = kvstore.layout_decode_s(spec, chunk_tokens)
        plans = kv.stream_plans(spec)
        n_groups = -(-chunk_tokens // spec.group)
        plan = kv.stream_plan(spec, chunk_tokens, gbps / 8, decode_s)   # kvcache's GB/s (1e9 bytes/s), a trace's Gb/s
        out[f"level{spec.level}"] = LayoutChoice(
            layout=plan.layout, gbps=gbps, chunk_tokens=chunk_tokens,
            bytes={p.layout: kv.context_bytes(spec, chunk_tokens, p) for p in plans},
            streams={p.layout: p.streams * n_groups for p in plans}, decode_s=dict(decode_s),
            bytes_only=kv.stream_plan(spec, chunk_tokens).layout)
    return out


@dataclass(frozen=True, kw_only=True)
class Prepared:
    """A context measured on this CPU; everything a run needs besides the trace and the policy."""
    plan: tuple               # (first token, tokens) per chunk
    ids: tuple                # the context's token ids
    question: tuple           # token ids read after the context: the answer's first token follows them
    specs: tuple              # the codec's CodecSpecs, finest level first
    options: tuple            # streaming.Options: the levels (bits per token as coded), text last
    payloads: dict            # option name -> bytes per chunk ("text": the token ids as int32)
    layouts: dict             # level name -> the stream layout its bitstreams are coded in (read from their headers)
    recompute_s: tuple        # measured seconds per chunk
    decode_s: dict            # level name -> measured seconds per chunk
    ref_logp: torch.Tensor    # the full prefill's first-answer-token log-probabilities (vocab,)
    ref_answer: tuple         # the full prefill's greedy tokens


def prepare(model, ids, question, chunk_tokens: int, specs, accuracy: dict | None = None,
            answer_tokens: int = answer.ANSWER_TOKENS, layouts: dict | str | None = None,
            keep_streams: bool = False) -> Prepared:
    """Measure a context on this CPU (see the module's docstring). accuracy: level -> the answer accuracy
    a chunk at that level counts for (the policy's quality; default 1 for every level); layouts: the
    bitstreams' stream layout, per level name (choose_layouts' choices) or one for every level (None: the
    codec's bytes-only choice, kvcache.stream_plan without a bandwidth); keep_streams: the bitstreams kept in
    the checkpoint folder, under the quantized KV they code (a bitstream is no timing: every time is
    measured in this call, and every bitstream decoded and checked bit for bit)."""
    plan = tuple(st.chunk_plan(len(ids), chunk_tokens))
    cache, recompute = None, []
    with torch.no_grad():
        model(torch.tensor([ids[:plan[0][1]]]), last=True)   # untimed: a model's first forward allocates its buffers
        for first, n in plan:
            t = time.perf_counter()
            _, cache = model(torch.tensor([ids[first:first + n]]), cache=cache, last=True)
            recompute.append(time.perf_counter() - t)
    X = kv_to_array(cache)[0]
    payloads, decode_s, options = {}, {}, []
    for spec in specs:
        name = f"level{spec.level}"
        layout = layouts[name] if isinstance(layouts, dict) else layouts
        payloads[name] = _streams(X, plan, spec, layout, keep_streams)
        decode_s[name] = []
        kv.codec_decode(payloads[name][0], specs, groups=[0])  # untimed: a spec's first decode builds its tables
        for (f, n), data in zip(plan, payloads[name]):
            before = chunk_kv.head(cache, f)
            t = time.perf_counter()              # the compute thread's work for a KV chunk, as a run does it
            q, _ = chunk_kv.decode_onto(before, data, spec, model.cfg.n_kv_heads, f, n)
            decode_s[name].append(time.perf_counter() - t)
            assert np.array_equal(q, kv.quantize(X[f:f + n], spec)), "a bitstream did not decode bit for bit"
        bits = 8 * sum(map(len, payloads[name])) / len(ids)
        options.append(st.Option(name, bits, 1.0 if accuracy is None else accuracy[spec.level],
                                 bits_per_value=bits / X[0].size))
    payloads["text"] = [np.asarray(ids[f:f + n], np.int32).tobytes() for f, n in plan]
    options.append(st.Option("text", 8 * st.TEXT_BYTES_PER_TOKEN, 1.0, recompute=True))
    ref_logp, ref_answer = answer.answer_after(model, cache, tuple(question), answer_tokens)
    return Prepared(plan=plan, ids=tuple(ids), question=tuple(question), specs=tuple(specs), options=tuple(options),
                    payloads=payloads, layouts={name: kv.codec_header(payloads[name][0], lengths=False)["layout"]
                                                for name in decode_s},
                    recompute_s=tuple(recompute),
                    decode_s={k: tuple(v) for k, v in decode_s.items()}, ref_logp=ref_logp, ref_answer=ref_answer)


def build_decoders(specs) -> None:
    """Each spec's decoder tables (its TableStack's lookup rows and search keys, about a second per level),
    built once before anything is timed: the first decode would otherwise build them. A function of the spec
    alone, so it may run while the model loads."""
    for spec in specs:
        stack = spec.stack
        for part in ("lookup", "keys", "cdf32", "width32", "empty_slices"):
            getattr(stack, part)


def _streams(X, plan, spec, layout, keep: bool) -> list:
    """Each chunk's bitstream; the chunks of one length coded side by side (kvcache.codec_encode_many);
    keep: cached under a digest of the quantized chunks, the spec and the layout (common.checkpoints)."""
    from common.checkpoints import cached

    def compute():
        out = {}
        for n in {n for _, n in plan}:
            firsts = [f for f, m in plan if m == n]
            out |= dict(zip(firsts, kv.codec_encode_many(np.stack([X[f:f + n] for f in firsts]), spec, layout)))
        return {"streams": [torch.frombuffer(bytearray(out[f]), dtype=torch.uint8) for f, _ in plan]}

    digest = hashlib.sha256()
    for f, n in plan:
        digest.update(np.ascontiguousarray(kv.quantize(X[f:f + n], spec)).tobytes())
    ident = {"symbols": digest.hexdigest(), "spec": spec.fingerprint, "layout": layout, "plan": plan}
    return cached("wire-streams", ident, compute, use=lambda d, _: [t.numpy().tobytes() for t in d["streams"]],
                  tag="wire", store=keep)
