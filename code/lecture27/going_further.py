"""Going further, for students who outgrow a laptop: each mechanism these scripts simulate, the knob of
the real system that sets it, and the value our constants use. The knobs are LMCache's configuration
(`lmcache/v1/config.py` of the LMCache repository: a YAML file named by LMCACHE_CONFIG_FILE, or one
LMCACHE_<KEY> environment variable per key) and vLLM's engine arguments. `run_all.py` prints the table and
puts it at the end of the report, with the values read from the pages the scripts saved.
"""
from __future__ import annotations

from common.present import Col, Row, Table

# the command that would start vLLM with LMCache behind it: it needs a GPU and is never run here
SERVE_COMMAND = ("LMCACHE_CONFIG_FILE=lmcache.yaml vllm serve meta-llama/Llama-3.1-8B-Instruct "
                 "--enable-prefix-caching "
                 "--kv-transfer-config '{\"kv_connector\":\"LMCacheConnectorV1\",\"kv_role\":\"kv_both\"}'")

# (mechanism, where it is here, the setting that holds our value: (script, field[, another script, field]),
#  unit, the knob, what it sets)
KNOBS = [
    ("chunk size", "05 Part 2: KV stored and evicted in chunks", ("05", "chunk"), "tokens",
     "chunk_size (default 256)", "tokens per stored KV chunk, the unit of lookup, storage and reuse"),
    ("CPU tier", "05 Part 2: the CPU DRAM tier", ("05", "cpu_gb"), "GB",
     "local_cpu: true, max_local_cpu_size (GB, default 5)", "pinned CPU memory the engine offloads KV into"),
    ("disk tier", "05 Part 2: the SSD tier", ("05", "ssd_gb"), "GB",
     "local_disk: \"file:///path/\", max_local_disk_size (GB)", "a local disk below the CPU tier"),
    ("CacheGen serializer", "02/03: the codec's quality levels, chunks streamed per level", ("03", "chunk_tokens"),
     "tokens per streamed chunk", "remote_serde: \"cachegen\" (default \"naive\")",
     "KV quantized and arithmetic-coded before it goes to a remote store"),
    ("blending", "04 §5.3: CacheBlend's selective recompute", ("04_smollm2", "real_ratio", "04", "ratio"),
     "recompute ratio",
     "enable_blending: true, blend_recompute_ratios [0.15], blend_check_layers [1]",
     "reuse non-prefix chunks, recompute the most deviated share of tokens, ranked at the check layer"),
    ("prefix caching", "the baseline CacheBlend improves on (§5.1)", None, "",
     "vLLM --enable-prefix-caching, --block-size (default 16)",
     "reuse of the identical leading blocks only, each block hashed with its parent's hash"),
]


def going_further_table(settings: dict[str, dict], wide: bool = True) -> Table:
    """The knobs table, our values read from `settings` (script -> the settings its page recorded); a
    value the saved pages do not hold is left blank. `wide=False` keeps the mechanism, our value and the
    knob (the terminal's 120 characters)."""
    rows = []
    for mechanism, here, setting, unit, knob, what in KNOBS:
        pairs = list(zip(setting[::2], setting[1::2])) if setting else []
        value = next((settings[p][f] for p, f in pairs if settings.get(p, {}).get(f) is not None), None)
        ours = "-" if value is None else f"{value:g} {unit}" if isinstance(value, (int, float)) else f"{value} {unit}"
        rows.append(Row([mechanism, here, ours, knob, what] if wide else [mechanism, ours, knob]))
    text = [Col("here", left=True), Col("our value"), Col("LMCache / vLLM knob", left=True),
            Col("what it sets", left=True)]
    columns = [Col("mechanism")] + (text if wide else [text[1], text[2]])
    return Table("Going further: each mechanism here and the real system's knob (LMCache's configuration, vLLM)",
                 "§6-7", columns, rows,
                 source="going_further.going_further_table",
                 notes=["To run the real thing (needs a GPU; not run here):", "    " + SERVE_COMMAND])
