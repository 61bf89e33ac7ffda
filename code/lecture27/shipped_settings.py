"""The numbered scripts' settings as they ship: writes shipped_settings.json beside them, the table a run
is compared with to tell a what-if (common.cli.shipped_defaults says why a table).

    python code/lecture27/shipped_settings.py           # write the table from the scripts' constants
    python code/lecture27/shipped_settings.py --check   # exit 1, naming every difference, if it is stale

A student's edit of a constant is a what-if and leaves the table alone. A change meant to ship (a new
default, a new setting) runs this once and commits the table with the change; tests/test_shipped_settings.py
fails until then. Each value is the Python literal of the setting, so a tuple stays a tuple and a dict's
number keys stay numbers.
"""
from __future__ import annotations

import ast
import dataclasses
import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path

from common import cli

HERE = Path(__file__).resolve().parent
TABLE = HERE / cli.SHIPPED_TABLE
SCRIPTS = sorted(HERE.glob("0[1-9]_*.py"))
REGENERATE = "python code/lecture27/shipped_settings.py"


def load_script(path: Path):
    """The numbered script at `path` as a module (its main() not run)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


def plain_run_settings(module):
    """The Settings a run of the script with no flags uses: what its parse() builds from an empty command
    line (a script whose parse() gives the command line builds them with its settings())."""
    parse = getattr(module, "parse", None) or module.command_line
    out = parse([])
    if isinstance(out, tuple):
        return out[0]
    return out if dataclasses.is_dataclass(out) else module.settings(out)


def literal(value, where: str) -> str:
    """`value` as a Python literal that reads back as the same value of the same types."""
    text = repr(value)
    try:
        back = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        back = None
    if back != value or repr(back) != text:
        raise SystemExit(f"{where}: {text} is not a Python literal the table can hold")
    return text


def shipped_rows() -> dict[str, dict[str, str]]:
    """script name -> {setting: the literal of its value} for a run of each script without flags."""
    cli.shipped_table = lambda path: {}   # no table while it is being written: each parse() compares with stand-ins
    rows = {}
    for path in SCRIPTS:
        s = plain_run_settings(load_script(path))
        rows[path.stem] = {k: literal(v, f"{path.name}: {k}") for k, v in sorted(dataclasses.asdict(s).items())}
    return rows


def differences(table: dict, rows: dict) -> list[str]:
    """Every setting whose value in the scripts is not the table's, in words."""
    out = []
    for script in sorted(set(table) | set(rows)):
        have, want = table.get(script), rows.get(script)
        if have is None or want is None:
            out.append(f"{script}: {'not in the table' if have is None else 'in the table, but no such script'}")
            continue
        for k in sorted(set(have) | set(want)):
            if have.get(k) != want.get(k):
                out.append(f"{script}.py: {k} is {want.get(k, '(no such setting)')} in the script, "
                           f"{have.get(k, '(not there)')} in {cli.SHIPPED_TABLE}")
    return out


def main(argv=None):
    os.environ["L27_FIGURES"] = tempfile.mkdtemp(prefix="l27-shipped-")   # every parse() checks the figures folder
    p = cli.Parser(__doc__, json=False)
    p.add_argument("--check", action="store_true", help="write nothing: exit 1 if the table and the scripts differ")
    a = p.parse_args(argv)
    rows = shipped_rows()
    if a.check:
        try:
            table = json.loads(TABLE.read_text())["scripts"]
        except (OSError, ValueError, KeyError):
            table = {}
        diff = differences(table, rows)
        if diff:
            print("\n".join(diff), file=sys.stderr)
            print(f"The scripts' defaults are not the shipped table's. A what-if of your own needs nothing; a change "
                  f"meant to ship: run `{REGENERATE}` and commit {cli.SHIPPED_TABLE} with it.", file=sys.stderr)
            sys.exit(1)
        print(f"{cli.SHIPPED_TABLE}: every script's defaults as the table has them")
        return
    about = (f"Every numbered script's settings for a run without flags, as shipped (Python literals). Written "
             f"by `{REGENERATE}`; do not edit: a run whose settings differ from these is a what-if.")
    TABLE.write_text(json.dumps({"about": about, "scripts": rows}, indent=1, sort_keys=True) + "\n")
    print(f"wrote {TABLE.relative_to(HERE.parents[1])}")


if __name__ == "__main__":
    main()
