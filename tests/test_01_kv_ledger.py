"""Smoke test of 01_kv_ledger.py as a student runs it: every part prints, --json has the spec's keys
with the handout's values (within 5%), and bad flags fail in one line with exit code 2."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "code" / "lecture27" / "01_kv_ledger.py"

SPEC = {  # spec section 01, [H] figures
    "llama31_70b_bytes_per_token": 327_680, "llama31_70b_32k_gb": 10.7, "deepseek_r1_kib_per_token": 68.6,
    "gpu_day_tb": 15.9, "recompute_16k_s": 0.97, "ex2_threshold_gbit_per_s": 14.4,
    "slides_breakeven_hit_rate_pct": 1.06, "slides_savings_musd": 33, "slides_storage_musd": 4,
    "ctx10k_storage_usd_per_h": 0.0005, "ctx10k_hit_saves_usd": 0.0026, "ctx10k_breakeven_hits_per_h": 0.19,
}


def run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("01") / "out.json"
    r = run("--json", str(out))
    assert r.returncode == 0, r.stderr
    return r.stdout, json.loads(out.read_text())


def test_prints_every_part(result):
    stdout, _ = result
    for part in ("Part 1", "One GPU's day", "Exercise 1", "Part 2", "Exercise 2", "Part 3", "(a)", "(b)",
                 "reading 1", "reading 2", "handout"):
        assert part in stdout
    assert "01_kv_size.png" in stdout and "01_breakeven_bandwidth.png" in stdout


@pytest.mark.parametrize("key", sorted(SPEC))
def test_json_keys_match_spec(result, key):
    _, data = result
    assert data[key] == pytest.approx(SPEC[key], rel=0.05)


def test_breakeven_list(result):
    _, data = result
    assert len(data["breakeven_gbytes_per_s"]) == len(data["contexts"])
    for n, b in zip(data["contexts"], data["breakeven_gbytes_per_s"]):
        if 4096 <= n <= 65536:
            assert 4 <= b <= 6


def test_exercise_flags_change_the_answer(tmp_path):
    out = tmp_path / "ex.json"
    r = run("--model", "llama-2-7b", "--context", "4096", "--compression", "6", "--no-plot", "--json", str(out))
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    assert data["ex1_bytes_per_token"] == 524_288
    assert data["ex1_context_gb"] == pytest.approx(524_288 * 4096 / 1e9)
    assert "LLaMA-2-7B" in r.stdout


@pytest.mark.parametrize("args", [["--context", "-5"], ["--model", "llama-9000"], ["--compression", "0"],
                                  ["--hit-rate", "2"], ["--no-such-flag"]])
def test_bad_flags_one_line_exit_2(args, cli_exit):
    code, err = cli_exit("01_kv_ledger", *args)
    assert code == 2
    assert len(err.strip().splitlines()) == 1
    assert "error" in err and "Traceback" not in err
