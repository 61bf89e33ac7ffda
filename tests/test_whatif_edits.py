"""A what-if is a what-if however it is made. In a scratch copy of the project (no git), a constant edited
at the top of 01, 03 or 05, the way the README teaches, gives the what-if banner on screen and in the
report, and draws into a folder of its own under figures/whatif/: every default figure keeps its bytes.
Two different trace files never share a what-if folder."""
import hashlib
import importlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from common.present import run_tag

ROOT = Path(__file__).resolve().parents[1]
CHECKPOINTS = os.environ.get("L27_CHECKPOINTS", str(ROOT / "code" / "checkpoints"))
# (script, its flags, the constant's line as shipped, the edit, the setting it changes)
EDITS = [
    ("01_kv_ledger.py", [], "\nCOMPRESSION = 3.0 ", "\nCOMPRESSION = 5.0 ", "compression = 5"),
    ("01_kv_ledger.py", [], "\nSTORAGE_TB_PER_NODE = 1.0 ", "\nSTORAGE_TB_PER_NODE = 4.0 ", "storage_tb_per_node = 4"),
    ("03_streaming.py", ["--no-real"], "\nSLO = 4.0 ", "\nSLO = 5.0 ", "slo = 5"),
    ("05_tiered_storage.py", [], "\nCPU_GB = 150.0 ", "\nCPU_GB = 60.0 ", "cpu_gb = 60"),
]


def run(clone: Path, script: str, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "L27_SEED"}
    # the copy is not the installed project: its own code/ goes first on the path, as an install of it would
    env.update(L27_FIGURES=str(clone / "figures"), L27_CHECKPOINTS=CHECKPOINTS, PYTHONDONTWRITEBYTECODE="1",
               PYTHONPATH=str(clone / "code"))
    out = subprocess.run([sys.executable, str(clone / "code" / "lecture27" / script), *args], capture_output=True,
                         text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def report(clone: Path) -> str:
    """The report as `run_all.py --report` rebuilds it from the clone's saved pages (in this process)."""
    from lecture27 import run_all
    mp = pytest.MonkeyPatch()
    mp.setenv("L27_FIGURES", str(clone / "figures"))
    try:
        return run_all.write_report(since=0.0).read_text()
    finally:
        mp.undo()


def default_figures(figures: Path) -> dict[str, str]:
    """Every figure of the default runs (figures/*.png, not under whatif/): name -> md5 of its bytes."""
    return {p.name: hashlib.md5(p.read_bytes()).hexdigest() for p in sorted(figures.glob("*.png"))}


@pytest.fixture(scope="module")
def clone(tmp_path_factory):
    """A copy of the project without git, checkpoints or figures, each edited script run once unedited."""
    root = tmp_path_factory.mktemp("clone")
    shutil.copytree(ROOT / "code", root / "code", ignore=shutil.ignore_patterns("checkpoints", "__pycache__"))
    assert not (root / ".git").exists()
    for script, args, *_ in EDITS:
        if not list((root / "figures").glob(script[:2] + "_*.png")):
            run(root, script, *args)
    return root


@pytest.mark.slow
@pytest.mark.parametrize("script,args,shipped,edit,change", EDITS, ids=[e[4] for e in EDITS])
def test_an_edited_constant_is_a_what_if(clone, script, args, shipped, edit, change):
    before = default_figures(clone / "figures")
    assert before
    path = clone / "code" / "lecture27" / script
    text = path.read_text()
    assert text.count(shipped) == 1, shipped
    try:
        path.write_text(text.replace(shipped, edit))
        printed = run(clone, script, *args)
    finally:
        path.write_text(text)
    assert printed.startswith("What-if: this run's settings differ from the defaults as shipped: " + change)
    drawn = re.findall(r"^figure: (.*)$", printed, re.M)
    assert drawn and all("figures/whatif/" + script[:2] + "_" in p for p in drawn), drawn
    assert default_figures(clone / "figures") == before        # the default figures' bytes are untouched
    doc = report(clone)
    section = doc.split(f'id="s{script[:2]}"')[1].split("<h2")[0]
    assert '<p class="whatif">What-if:' in section and change in section
    assert re.search(r"<b>what-if sections</b></td><td>[^\n]*" + re.escape(change), doc)


@pytest.mark.slow
def test_two_traces_give_two_folders(tmp_path, monkeypatch):
    """The same trace file, its last row changed between two runs: two folders, each named by the file and
    a digest of the trace, no comma in either."""
    monkeypatch.setenv("L27_FIGURES", str(tmp_path))
    mod = importlib.import_module("lecture27.03_streaming")
    trace = tmp_path / "mytrace.csv"
    folders = []
    for last in ("3.0,4.0", "3.0,6.0"):
        trace.write_text("0.0,5.0\n1.0,0.5\n2.5,0.2\n" + last + "\n")
        page = mod.main(["--trace", str(trace), "--no-real", "--no-plot"])
        folders.append(page.figures)
    assert folders[0] != folders[1] and folders[0].parent == folders[1].parent == tmp_path / "whatif"
    for f in folders:
        assert f.name.startswith("03_trace+trace_file=mytrace.csv_") and "," not in f.name


def test_a_folder_name_is_readable_and_its_digest_tells_inputs_apart():
    assert run_tag({"compression": 5.0}).startswith("compression=5_")
    assert run_tag({"ratio": 0.1, "chunk_len": 6}).startswith("chunk_len=6+ratio=0.1_")
    a, b = run_tag({"trace": ((0.0, 5.0), (3.0, 4.0))}), run_tag({"trace": ((0.0, 5.0), (3.0, 6.0))})
    assert a != b and a.startswith("trace_") and b.startswith("trace_")
    assert run_tag({"x": "a/b"}) != run_tag({"x": "a_b"})        # the same readable name, two digests
    long = run_tag({f"setting_{i}": i for i in range(30)})
    assert len(long) <= 90
