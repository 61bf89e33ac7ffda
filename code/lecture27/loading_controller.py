"""CacheBlend's loading controller on the time model (handout §5.4, exercise 8).

Layer l's selective recompute needs only layer l - 1's result, so reading layer l + 1's KV from storage
and recomputing layer l's few tokens run at the same time: each layer costs max(read, recompute). The
controller has two halves:
  the ratio    recompute as much as the read hides (recompute time = read time), never below the quality
               floor (15%), never above everything;
  the storage  keep the KV on a device whose read adds no delay; and when reading a layer takes longer
               than prefilling it, do not reuse at all: a full prefill, or the fastest device that still
               pays. At a ratio of 100% the loaded KV would never be used, and the TTFT would still wait
               for the reads.

    load_time          seconds to read one layer's KV of n tokens from a device
    controller_ratio   the ratio half
    pipelined_ttft     n layers of max(read, recompute), then the question
    streamed_s         the same pipeline as two CUDA streams run it: the first read alone, n - 1 steps of
                       max(read, recompute), the last recompute (what a GPU measures; gpu_check.py)
    ranked_ttft        the same when the set is ranked by the question's attention at layers 1..j: the
                       recompute waits for layers 0..j's KV and the question's pass over them
    choose             the whole controller: blend from which device at which ratio, or a full prefill, and why
"""
from __future__ import annotations

from dataclasses import dataclass

from common import timemodel as tm

BLEND, FULL_PREFILL = "blend", "full prefill"


def load_time(model, n_tokens: int, device: str, n_gpus: int, devices: dict) -> float:
    """Seconds to read one layer's KV for n_tokens from `device`. devices: name -> (how, bytes/s), how
    "per_gpu" (each GPU reads its share over its own link, e.g. pinned CPU memory over PCIe) or "shared"
    (one device serves every GPU, e.g. a disk)."""
    how, bandwidth = devices[device]
    m = tm.get_model(model)
    nbytes = tm.kv_bytes_per_token(m) / m.n_layers * n_tokens
    return nbytes / (bandwidth * (n_gpus if how == "per_gpu" else 1))


def controller_ratio(load_s: float, full_recompute_s: float, min_ratio: float) -> float:
    """The ratio half of CacheBlend's loading controller: recompute as much as loading the layer hides
    (recompute time is proportional to the ratio), but never less than the quality floor, never more
    than all."""
    return min(1.0, max(min_ratio, load_s / full_recompute_s))


def pipelined_ttft(n_layers: int, load_s: float, recompute_s: float, extra_s: float = 0.0) -> float:
    """Layer l's recompute overlaps layer l+1's load: each layer costs max(load, recompute); extra_s
    (the question's prefill) comes after."""
    return n_layers * max(load_s, recompute_s) + extra_s


def streamed_s(n_layers: int, load_s: float, recompute_s: float) -> float:
    """The layers' loads on one stream, their recomputes on another, layer l's recompute waiting for layer l's
    load: the first load runs alone, then n - 1 steps each as long as the longer of a load and a recompute
    (layer l + 1 loading while layer l recomputes), then the last recompute. pipelined_ttft counts n steps of
    the longer instead: the same when n is large."""
    return load_s + (n_layers - 1) * max(load_s, recompute_s) + recompute_s


def ranked_ttft(n_layers: int, load_s: float, recompute_s: float, depth: int, pass_s: float,
                extra_s: float = 0.0) -> float:
    """pipelined_ttft for a rule that ranks the tokens by the question's attention at layers 1..`depth`
    (a query rule): no layer can recompute before the ranking is known, and the ranking needs layers
    0..depth's KV read and the question's pass over them (pass_s per layer, overlapping the reads):
    (depth + 1) x max(load, pass) first. Then the recompute of all n layers runs while the other
    n - depth - 1 layers load: max((n - depth - 1) x load, n x recompute). depth -1 (no ranking pass) is
    pipelined_ttft; depth n - 1 reads every layer before recomputing any: no overlap is left."""
    wait = (depth + 1) * max(load_s, pass_s)
    return wait + max((n_layers - depth - 1) * load_s, n_layers * recompute_s) + extra_s


@dataclass(frozen=True, kw_only=True)
class Choice:
    """What the controller does for one request, and why.
    choice: BLEND or FULL_PREFILL; device: where the KV is read from (None: nothing is read); ratio: the
    context's recompute ratio (1.0 for a full prefill); ttft_s: the chosen plan's TTFT; full_s: a full
    prefill's; stored: the device the KV was kept on; read_s / full_layer_s: one layer's read from it and
    one layer's full prefill, the two numbers the choice turns on; stored_ratio / stored_ttft_s: blending
    from `stored` anyway, at the ratio half's ratio (what the choice avoids when it is not that); reason:
    the choice in one sentence."""
    choice: str
    device: str | None
    ratio: float
    ttft_s: float
    full_s: float
    stored: str
    read_s: float
    full_layer_s: float
    stored_ratio: float
    stored_ttft_s: float
    reason: str


def choose(n_layers: int, full_layer_s: float, loads: dict, stored: str, min_ratio: float,
           extra_s: float = 0.0) -> Choice:
    """The controller for KV kept on device `stored`. loads: device -> seconds to read one layer's KV
    (the devices the KV could be kept on; `stored` among them); full_layer_s: one layer's full prefill of
    the context; extra_s: the question's prefill, after the layers.
    Reading from `stored` pays when it is faster than prefilling the layer: blend at controller_ratio.
    Otherwise reusing cannot beat a full prefill (every layer would wait for its read): the fastest
    device whose read does pay, else a full prefill. A floor of 100% is a full prefill too."""
    full_s = n_layers * full_layer_s + extra_s
    read = loads[stored]

    def blend_from(device: str) -> tuple[float, float]:
        r = controller_ratio(loads[device], full_layer_s, min_ratio)
        return r, pipelined_ttft(n_layers, loads[device], r * full_layer_s, extra_s)

    ms = lambda s: f"{1e3 * s:.0f} ms" if s >= 0.1 else f"{1e3 * s:.3g} ms"  # noqa: E731
    stored_r, stored_ttft = blend_from(stored)
    base = dict(stored=stored, read_s=read, full_layer_s=full_layer_s, stored_ratio=stored_r,
                stored_ttft_s=stored_ttft)
    if min_ratio >= 1:  # the floor recomputes everything: the stored KV would never be used
        return Choice(choice=FULL_PREFILL, device=None, ratio=1.0, ttft_s=full_s, full_s=full_s, **base,
                      reason=f"a {min_ratio:.0%} floor recomputes every token: no reuse, a full prefill")
    if read < full_layer_s:
        how = (f"the read hides the {min_ratio:.0%} floor's recompute" if stored_r == min_ratio else
               f"recompute {stored_r:.0%} (recompute = read)")
        return Choice(choice=BLEND, device=stored, ratio=stored_r, ttft_s=stored_ttft, full_s=full_s, **base,
                      reason=f"reading a layer from {stored} ({ms(read)}) is faster than prefilling it "
                      f"({ms(full_layer_s)}): blend, {how}")
    than = "as long as" if read == full_layer_s else "longer than"
    slower = (f"reading a layer from {stored} ({ms(read)}) takes {than} prefilling it ({ms(full_layer_s)}), "
              f"so every layer would wait for its read (blending anyway: {ms(stored_ttft)} to the first token)")
    paying = [d for d in loads if loads[d] < full_layer_s]
    if paying:
        best = min(paying, key=lambda d: blend_from(d)[1])
        r, ttft = blend_from(best)
        return Choice(choice=BLEND, device=best, ratio=r, ttft_s=ttft, full_s=full_s, **base,
                      reason=f"{slower}; {best} reads it in {ms(loads[best])}: keep the KV there and blend at {r:.0%}")
    return Choice(choice=FULL_PREFILL, device=None, ratio=1.0, ttft_s=full_s, full_s=full_s, **base,
                  reason=f"{slower}: no reuse, a full prefill ({ms(full_s)})")
