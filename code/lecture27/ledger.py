"""The KV ledger (handout §1): how big a context's KV is, how much a GPU makes per day, whether
fetching it beats recomputing it (the break-even bandwidth), and whether storing it pays.

Pure functions that return data; 01_kv_ledger.py prints and plots. Times come from common.timemodel;
prices and tier bandwidths are documented inputs. Every function takes the bytes per value (2 for BF16)
from its caller: the script's setting is the one name for it.
"""
from __future__ import annotations

from dataclasses import dataclass

from common import timemodel as tm

SECONDS_PER_DAY = 86_400
HOURS_PER_YEAR = 365 * 24

# Where a stored KV cache is fetched from: read bandwidth into the serving node, bytes/s.
TIERS = {
    "CPU DRAM": 64e9,             # one PCIe Gen5 x16 link, 64 GB/s each way (H100 SXM datasheet)
    "local NVMe": 7e9,            # one PCIe Gen4 NVMe SSD, ~7 GB/s sequential read (e.g. Samsung PM1733 datasheet)
    "RDMA network": 50e9,         # one 400 Gb/s InfiniBand NDR NIC (NVIDIA ConnectX-7)
    "cross-cloud 10 Gb/s": 1.25e9,  # a 10 Gb/s wide-area link (the handout's example, §1.4)
}


def kv_bytes(model, n_tokens, bytes_per_value) -> int:
    """Bytes of KV for n_tokens tokens of context."""
    return tm.kv_bytes_per_token(model, bytes_per_value) * int(n_tokens)


@dataclass(frozen=True)
class Layout:
    """What one token caches per layer: K/V heads x head dim, or MLA's latent width (then no heads)."""
    layers: int
    kv_heads: int | None
    head_dim: int | None
    mla_latent: int | None


def kv_layout(model) -> Layout:
    m = tm.get_model(model)
    latent = m.kv_latent or None
    return Layout(m.n_layers, None if latent else m.n_kv_heads, None if latent else m.head_dim, latent)


def gpu_day_bytes(model, tokens_per_s, bytes_per_value) -> float:
    """KV one GPU produces in a day at a given generation throughput (prompt + output tokens/s)."""
    return tokens_per_s * tm.kv_bytes_per_token(model, bytes_per_value) * SECONDS_PER_DAY


def fetch_time(nbytes, bytes_per_s) -> float:
    return nbytes / bytes_per_s


def breakeven_bandwidth(model, gpu, n_ctx, n_gpus, bytes_per_value, compression=1.0) -> float:
    """Bytes/s above which fetching a stored context's KV beats recomputing it:
    (KV bytes / compression ratio) / recompute time."""
    return kv_bytes(model, n_ctx, bytes_per_value) / compression / tm.prefill_time(model, gpu, n_ctx, 0, n_gpus)


@dataclass(frozen=True)
class FetchRow:
    """One context length: its KV, the time to recompute it, the break-even bandwidth, and the seconds to
    fetch it from each tier (tier name -> s)."""
    context: int
    kv_bytes: int
    recompute_s: float
    breakeven_bytes_per_s: float
    fetch_s: dict


def fetch_or_recompute(model, gpu, n_gpus, contexts, bytes_per_value, compression=1.0, tiers=TIERS) -> list:
    """One FetchRow per context length."""
    rows = []
    for n in contexts:
        nbytes = kv_bytes(model, n, bytes_per_value)
        t_re = tm.prefill_time(model, gpu, n, 0, n_gpus)
        rows.append(FetchRow(n, nbytes, t_re, nbytes / compression / t_re,
                             {name: fetch_time(nbytes / compression, bw) for name, bw in tiers.items()}))
    return rows


@dataclass(frozen=True, kw_only=True)
class SlidesAccount:
    node_usd_per_h: float
    storage_usd_per_h: float
    hours: float
    breakeven_if_hit_saves_all: float   # a hit saves 100% of the GPU time
    breakeven_hit_rate: float
    gpu_time_saved_usd: float
    storage_usd: float
    net_usd: float                      # reading 1: the slides' "$33M" is net of storage
    net_if_33m_read_as_gross_usd: float  # reading 2: the net taken as gross, storage paid again


def slides_economics(gpu_hour_usd, gpus_per_node, storage_tb_per_node, storage_usd_per_tb_hour,
                     hit_saves, hit_rate, nodes, years) -> SlidesAccount:
    """The slides' account of storing KV (all inputs are the slides' assumptions except hit_saves).
    A node pays for its GPUs and for its storage tier every hour. A request that hits the cache saves
    `hit_saves` of its GPU time (not all of it: the fetch and the decode remain). Storage pays for
    itself once hit_rate * hit_saves * GPU cost >= storage cost."""
    node_usd_h = gpu_hour_usd * gpus_per_node
    storage_usd_h = storage_tb_per_node * storage_usd_per_tb_hour
    hours = years * HOURS_PER_YEAR
    saved = hit_rate * hit_saves * node_usd_h * hours * nodes      # GPU time saved, $
    storage = storage_usd_h * hours * nodes                       # storage paid, $
    return SlidesAccount(node_usd_per_h=node_usd_h, storage_usd_per_h=storage_usd_h, hours=hours,
                         breakeven_if_hit_saves_all=storage_usd_h / node_usd_h,
                         breakeven_hit_rate=storage_usd_h / (node_usd_h * hit_saves), gpu_time_saved_usd=saved,
                         storage_usd=storage, net_usd=saved - storage,
                         net_if_33m_read_as_gross_usd=(saved - storage) - storage)


@dataclass(frozen=True)
class ContextAccount:
    context: int
    kv_bytes: int
    recompute_s: float
    storage_usd_per_h: float
    hit_saves_usd: float
    breakeven_hits_per_h: float


def context_economics(model, gpu, n_gpus, n_ctx, gpu_hour_usd, storage_usd_per_tb_hour,
                      bytes_per_value) -> ContextAccount:
    """This lecture's own account for one stored context: what an hour of storage costs, what one hit
    saves (the recompute time of the whole node), and how many hits per hour pay for the storage."""
    nbytes = kv_bytes(model, n_ctx, bytes_per_value)
    storage_usd_h = nbytes / 1e12 * storage_usd_per_tb_hour
    t_re = tm.prefill_time(model, gpu, n_ctx, 0, n_gpus)
    hit_saves_usd = t_re / 3600 * gpu_hour_usd * n_gpus
    return ContextAccount(n_ctx, nbytes, t_re, storage_usd_h, hit_saves_usd, storage_usd_h / hit_saves_usd)
