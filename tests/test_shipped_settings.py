"""The defaults a run is compared with are the ones shipped: code/lecture27/shipped_settings.json holds every
numbered script's settings for a run without flags, equal to the constants in the files (a constant edited
without regenerating the table fails here, and says how to regenerate), read back with their types, and
common.cli.shipped_defaults gives them however the constants were edited since."""
import dataclasses
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from common import cli
from common.present import edited

ROOT = Path(__file__).resolve().parents[1]
GENERATOR = ROOT / "code" / "lecture27" / "shipped_settings.py"
SCRIPTS = sorted(p.stem for p in (ROOT / "code" / "lecture27").glob("0[1-5]_*.py"))


def clone_env(root: Path) -> dict:
    """The environment of a process run from the clone at `root`: no test's seed, and the clone's own code/ first
    on the path (a copy is not the installed project)."""
    env = {k: v for k, v in os.environ.items() if k != "L27_SEED"}
    return dict(env, PYTHONPATH=str(root / "code"))


def check(root: Path) -> subprocess.CompletedProcess:
    """`shipped_settings.py --check` in the clone at `root`, in a process of its own: the constants as the
    files hold them (no test's seed, no monkeypatch)."""
    return subprocess.run([sys.executable, str(root / "code" / "lecture27" / "shipped_settings.py"), "--check"],
                          capture_output=True, text=True, env=clone_env(root), timeout=300)


@pytest.mark.slow
def test_the_table_is_the_constants_of_the_shipped_files():
    out = check(ROOT)
    assert out.returncode == 0, ("the shipped table and the scripts' constants differ:\n" + out.stderr)
    table = json.loads((ROOT / "code" / "lecture27" / cli.SHIPPED_TABLE).read_text())["scripts"]
    assert sorted(table) == SCRIPTS


@pytest.mark.slow
def test_a_constant_edited_without_regenerating_fails_the_check_and_says_how(tmp_path):
    """A copy of code/ (no git) with 05's CPU_GB edited: the check names the setting, both values and the
    command that regenerates the table; regenerating makes it pass."""
    import shutil
    shutil.copytree(ROOT / "code", tmp_path / "code", ignore=shutil.ignore_patterns("checkpoints", "__pycache__"))
    script = tmp_path / "code" / "lecture27" / "05_tiered_storage.py"
    text = script.read_text()
    assert "\nCPU_GB = 150.0 " in text
    script.write_text(text.replace("\nCPU_GB = 150.0 ", "\nCPU_GB = 99.0 "))
    out = check(tmp_path)
    assert out.returncode == 1
    assert "05_tiered_storage.py: cpu_gb is 99.0 in the script, 150.0 in shipped_settings.json" in out.stderr
    assert "python code/lecture27/shipped_settings.py" in out.stderr
    subprocess.run([sys.executable, str(tmp_path / "code" / "lecture27" / "shipped_settings.py")], check=True,
                   capture_output=True, env=clone_env(tmp_path), timeout=300)
    assert check(tmp_path).returncode == 0


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_run_without_flags_is_not_a_what_if(script):
    """The shipped defaults, read back from the table with their types (tuples, a dict's number keys), equal
    the settings of a run without flags: nothing to tell. (With L27_SEED the record model's seed is not
    the shipped one: that run is a what-if, rightly.)"""
    from lecture27 import shipped_settings
    mod = importlib.import_module(f"lecture27.{script}")
    changes = edited(shipped_settings.plain_run_settings(mod), cli.shipped_defaults(mod.Settings, vars(mod)))
    assert set(changes) <= ({"seed"} if os.environ.get("L27_SEED") else set()), changes


def test_an_edited_constant_differs_from_the_shipped_default(monkeypatch):
    mod = importlib.import_module("lecture27.01_kv_ledger")
    monkeypatch.setattr(mod, "COMPRESSION", 5.0)
    s, defaults, _ = mod.parse([])
    assert defaults.compression == 3.0 and edited(s, defaults) == {"compression": 5.0}


@dataclasses.dataclass(frozen=True)
class Settings:
    steps: tuple
    probs: dict
    ratio: float = 0.5


def test_shipped_defaults_read_the_table_beside_the_script(tmp_path):
    """The table's row for the script named by the namespace's __file__: its literals keep their types; a
    setting the table lacks, or a script it does not know, takes the constant as it is now."""
    (tmp_path / cli.SHIPPED_TABLE).write_text(json.dumps({"scripts": {"09_demo": {
        "steps": "(1, 2, 4)", "probs": "{0: 0.5, -1: 0.5}"}}}))
    now = {"__file__": str(tmp_path / "09_demo.py"), "STEPS": [1, 2, 8], "PROBS": {0: 1.0}, "RATIO": 0.25}
    got = cli.shipped_defaults(Settings, now)
    assert got == Settings((1, 2, 4), {0: 0.5, -1: 0.5}, 0.25)
    assert edited(cli.settings_from(Settings, cli.argparse.Namespace(), now), got) == {
        "steps": (1, 2, 8), "probs": {0: 1.0}}
    other = cli.shipped_defaults(Settings, {**now, "__file__": str(tmp_path / "my_copy.py")})
    assert other == Settings((1, 2, 8), {0: 1.0}, 0.25)


@dataclasses.dataclass(frozen=True)
class Wider:
    steps: tuple
    layers: int                 # a setting that no constant names and the table does not hold yet


def test_a_setting_the_table_lacks_is_shown_as_changed_not_a_crash(tmp_path):
    (tmp_path / cli.SHIPPED_TABLE).write_text(json.dumps({"scripts": {"09_demo": {"steps": "(1, 2, 4)"}}}))
    got = cli.shipped_defaults(Wider, {"__file__": str(tmp_path / "09_demo.py"), "STEPS": (1, 2, 4)})
    assert got.steps == (1, 2, 4) and got.layers is None
    assert edited(Wider((1, 2, 4), 32), got) == {"layers": 32}
    assert dataclasses.replace(got, layers=8) == Wider((1, 2, 4), 8)
