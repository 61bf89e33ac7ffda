"""Going further, for students who outgrow a laptop: each mechanism these scripts simulate, the knob of
the real system that sets it, and the value our constants use. The knobs are LMCache's configuration
(`lmcache/v1/config.py` of the LMCache repository: a YAML file named by LMCACHE_CONFIG_FILE, or one
LMCACHE_<KEY> environment variable per key) and vLLM's engine arguments. `run_all.py` prints the table and
puts it at the end of the report, with the values read from the pages the scripts saved.
"""
from __future__ import annotations

from common.present import Col, Row, Table, pct0

# the command that would start vLLM with LMCache behind it: it needs a GPU and is never run here
SERVE_COMMAND = ("LMCACHE_CONFIG_FILE=lmcache.yaml vllm serve meta-llama/Llama-3.1-8B-Instruct "
                 "--enable-prefix-caching "
                 "--kv-transfer-config '{\"kv_connector\":\"LMCacheConnectorV1\",\"kv_role\":\"kv_both\"}'")

# (mechanism, where it is here, the settings that hold our values: (script, field, what the value is of),
#  how a value is written, the knob, what it sets)
tokens, gb = "{:,g} tokens".format, "{:,g} GB".format
KNOBS = [
    ("chunk size", "05 Part 2: KV stored and evicted in chunks (CHUNK)", [("05", "chunk", "")], tokens,
     "chunk_size (default 256)", "tokens per stored KV chunk, the unit of lookup, storage and reuse"),
    ("CPU tier", "05 Part 2: the CPU DRAM tier (CPU_GB)", [("05", "cpu_gb", "")], gb,
     "local_cpu: true, max_local_cpu_size (GB, default 5)", "pinned CPU memory the engine offloads KV into"),
    ("disk tier", "05 Part 2: the SSD tier (SSD_GB)", [("05", "ssd_gb", "")], gb,
     "local_disk: \"file:///path/\", max_local_disk_size (GB)", "a local disk below the CPU tier"),
    ("CacheGen serializer", "02/03: the codec's levels, streamed in chunks (CHUNK_TOKENS); serve.py --serde cachegen: "
     "the engine's disk and Redis records in it (05 Part 6, SERVE_SERDE_GB)",
     [("03", "chunk_tokens", "")], "{:,g} tokens a chunk".format, "remote_serde: \"cachegen\" (default \"naive\")",
     "KV quantized and arithmetic-coded before it goes to a remote store"),
    ("blending", "04 §5.3: selective recompute (RATIO, REAL_RATIO; the check-k rule ranks at layer 1)",
     [("04", "ratio", " (record world)"), ("04_smollm2", "real_ratio", " (SmolLM2)")], pct0,
     "enable_blending: true, blend_recompute_ratios [0.15], blend_check_layers [1]",
     "reuse non-prefix chunks, recompute the most deviated share of tokens, ranked at the check layer"),
    ("prefix caching", "the baseline CacheBlend improves on (§5.1; 05 Part 4's prefix cache)", [], str,
     "vLLM --enable-prefix-caching, --block-size (default 16)",
     "reuse of the identical leading blocks only, each block hashed with its parent's hash"),
]


def going_further_table(settings: dict[str, dict], wide: bool = True) -> Table:
    """The knobs table, our values read from `settings` (script -> the settings its page recorded): each
    value of a mechanism the saved pages hold, with what it is of ("20% (record world), 15% (SmolLM2)");
    none: blank. `wide=False` keeps the mechanism, our value and the knob, one value a line (the terminal's
    120 characters)."""
    rows = []
    for mechanism, here, where, fmt, knob, what in KNOBS:
        values = [fmt(settings[p][f]) + of for p, f, of in where if settings.get(p, {}).get(f) is not None]
        if wide:
            rows.append(Row([mechanism, here, ", ".join(values) or "-", knob, what]))
        else:
            rows += [Row([mechanism, values[0] if values else "-", knob])] + [Row(["", v, ""]) for v in values[1:]]
    text = [Col("here", left=True), Col("our value"), Col("LMCache / vLLM knob", left=True),
            Col("what it sets", left=True)]
    columns = [Col("mechanism")] + (text if wide else [text[1], text[2]])
    return Table(title="Going further: each mechanism here and the real system's knob (LMCache's configuration, vLLM)",
                 section="§6-7", cols=columns, rows=rows,
                 source="store.going_further.going_further_table",
                 notes=["To run the real thing (needs a GPU; not run here):", "    " + SERVE_COMMAND])
