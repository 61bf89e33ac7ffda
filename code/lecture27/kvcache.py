"""The lecture's KV toolbox: the KV ledger (sections 1), the arithmetic coder and the CacheGen-style
codec (section 3), and `shift_kv` (section 5). Pure functions that return data; the numbered
scripts print and plot.

Sections of this file (each owned by one part of the lecture):
  1. KV ledger               -- sizes, a GPU's KV per day, fetch vs recompute, storage economics
  2. Arithmetic coder        -- static-table integer arithmetic coding
  3. CacheGen-style codec    -- anchor + delta, per-layer quantization, per-(channel, layer) tables
  4. shift_kv                -- move a precomputed chunk's K to new positions (RoPE composes)
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # code/ holds `common`

# =============================================================================== 1. KV ledger
# (section 1: owned by the time-model / 01_kv_ledger work)


# ========================================================================= 2. Arithmetic coder
# (section 3.3: owned by the codec work)


# ===================================================================== 3. CacheGen-style codec
# (section 3.3-3.4: owned by the codec work)


# ============================================================================== 4. shift_kv
def shift_kv(k, delta, theta: float):
    """Move K (..., T, head_dim), cached after RoPE, by `delta` positions (an int, or a tensor of
    T per-token offsets): rotate once more by delta * theta^(-2i/d) (CacheBlend, appendix A).
    V carries no position and is reused as it is."""
    import torch
    from common.llama import rope

    T = k.shape[-2]
    d = delta if isinstance(delta, torch.Tensor) else torch.full((T,), float(delta))
    return rope(k, d, theta)
