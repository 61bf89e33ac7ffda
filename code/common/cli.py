"""What every numbered script shares: argument parsing with one-line errors, the output paths checked
before any work starts, and the frozen settings object a script builds from its constants and the command
line. Tables, figures and `--json` are common/present.py's. Nothing here computes a lecture figure."""
from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import math
import os
import sys
from pathlib import Path

from .present import check_writable_dir, check_writable_file, figures_dir


class _Help(argparse.HelpFormatter):
    """Each option that takes a value ends its help with its default, the script's constant; an on/off
    flag and an option without a default (--json) print none."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.nargs != 0 and action.default not in (None, argparse.SUPPRESS) and "%(default)" not in text:
            text += " (default: %(default)s)"
        return text


class Parser(argparse.ArgumentParser):
    """argparse with a one-line error and exit code 2 (no usage dump, no traceback)."""

    def __init__(self, doc: str, json: bool = True, **kw):
        # the module docstring's first paragraph is the description
        super().__init__(description=doc.strip().split("\n\n")[0], formatter_class=_Help, **kw)
        if json:
            self.add_argument("--json", metavar="PATH", help="write the headline figures to this JSON file")
        self.add_argument("--no-plot", action="store_true", help="draw no figures")

    def parse_args(self, args=None, namespace=None):
        """Parse, then refuse an unwritable --json path or figures/ folder before any work starts."""
        a = super().parse_args(args, namespace)
        if getattr(a, "json", None):
            why = check_writable_file(a.json)
            if why:
                self.error(f"argument --json: {why}")
        why = check_writable_dir(figures_dir())
        if why:
            self.error(f"the figures folder: {why} (set L27_FIGURES=/another/folder)")
        return a

    def error(self, message):
        fail(message, prog=self.prog)


def settings(namespace: dict):
    """Class decorator that makes a script's frozen Settings dataclass: one field per UPPER_CASE constant of two
    or more letters assigned at the top of the script above the class (field chunk_len <- CHUNK_LEN, in the
    order they are written), then the fields the class itself declares (settings no constant holds: which
    Parts run, a server's URL; each with its default). The constants are the one list of the script's
    settings: the class does not list them again. `namespace`: the script's globals()."""
    def make(cls):
        own = dict(cls.__dict__.get("__annotations__", {}))
        names = [n for n in top_constants(Path(namespace["__file__"]), cls.__name__) if n.lower() not in own]
        cls.__annotations__ = {**{n.lower(): _kind(namespace[n]) for n in names}, **own}
        return dataclasses.dataclass(frozen=True)(cls)
    return make


def top_constants(script: Path, above: str) -> list[str]:
    """The UPPER_CASE names (two or more letters) that the module-level statements of `script` assign before
    the class `above`, in order: a script's settings."""
    out = []
    for node in ast.parse(script.read_text()).body:
        if isinstance(node, ast.ClassDef) and node.name == above:
            break
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node,
                                                                                                ast.AnnAssign) else []
        out += [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name) and n.id.isupper()
                and len(n.id) > 1 and n.id not in out]
    return out


def _kind(value) -> type:
    """A setting's type as its field declares it: a list is frozen into a tuple (constants_of)."""
    return tuple if isinstance(value, list) else object if value is None else type(value)


def constants_of(cls, namespace: dict) -> dict:
    """The script constants behind cls's fields (field chunk_len <- CHUNK_LEN), read from the script's
    globals() at call time, so a student's edit is what the run uses; lists become tuples (frozen)."""
    out = {f.name: namespace[f.name.upper()] for f in dataclasses.fields(cls) if f.name.upper() in namespace}
    return {k: tuple(v) if isinstance(v, list) else v for k, v in out.items()}


SHIPPED_TABLE = "shipped_settings.json"   # beside the numbered scripts; written by shipped_settings.py


def shipped_defaults(cls, namespace: dict):
    """The script's Settings as shipped: what a run is compared with to tell a what-if (`namespace`: the
    script's globals()). A run whose settings differ from these, by a flag or by a constant edited in the
    file, is a what-if: its figures go under figures/whatif/, a banner says so on screen and in the report.

    "As shipped" is a table committed beside the scripts, code/lecture27/shipped_settings.json: every
    script's settings for a run without flags, written by `python code/lecture27/shipped_settings.py` from
    the constants as they ship. Not the constants themselves (a student's edit moves them, and a dataclass
    default is the edited constant too), not git (a zip or a copy of the project has no history, and a
    student's own commit is not what shipped), not a second copy of each value in the script (two names for
    one setting drift apart). An edit leaves the table alone, so the run is told apart from it; a test
    (tests/test_shipped_settings.py) fails when a constant and the table disagree, so a change meant to
    ship regenerates the table. Its values are Python literals as text: JSON alone would turn a tuple into
    a list and a dict's number keys into strings, and the comparison would see edits nobody made.

    A field the table lacks (a setting added since it was written) or a script it does not know (a copy
    under another name) takes the constant's value as it is now, so that setting's edits are not told; a
    field with no constant either takes its default, else None, so the run shows it as changed."""
    script = Path(namespace.get("__file__", "")).stem
    row = shipped_table(Path(namespace.get("__file__", "")).resolve().parent / SHIPPED_TABLE).get(script, {})
    fields = dataclasses.fields(cls)
    values = {**constants_of(cls, namespace), **{k: v for k, v in row.items() if k in {f.name for f in fields}}}
    missing = {f.name: None for f in fields if f.name not in values and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING}
    return cls(**values, **missing)


def shipped_table(path: Path) -> dict[str, dict]:
    """script name -> {setting: value as shipped}, read from the table at `path` ({} when there is none)."""
    try:
        scripts = json.loads(Path(path).read_text())["scripts"]
    except (OSError, ValueError, KeyError):
        return {}
    return {name: {k: ast.literal_eval(v) for k, v in row.items()} for name, row in scripts.items()}


def settings_from(cls, ns: argparse.Namespace, constants: dict | None = None, **more):
    """The frozen settings dataclass `cls`: each field from the parsed command line, else from the script's
    constant of that name (`constants`: the script's globals(); see constants_of), else its default;
    `more` overrides all."""
    names = {f.name for f in dataclasses.fields(cls)}
    values = {k: v for k, v in vars(ns).items() if k in names}
    return cls(**{**(constants_of(cls, constants) if constants else {}), **values, **more})


def fail(message: str, prog: str | None = None) -> None:
    """Report bad input in one line on stderr and exit with code 2."""
    prog = prog or Path(sys.argv[0]).name
    print(f"{prog}: error: {message}", file=sys.stderr)
    sys.exit(2)


def _check(kind, ok, what):
    def parse(s):
        try:
            x = kind(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{s!r} is not a number")
        if not (math.isfinite(x) and ok(x)):
            raise argparse.ArgumentTypeError(f"{s!r} must be {what}")
        return x
    return parse


positive_int = _check(int, lambda x: x > 0, "a positive integer")
nonneg_int = _check(int, lambda x: x >= 0, "zero or a positive integer")
positive_float = _check(float, lambda x: x > 0, "positive")
nonneg_float = _check(float, lambda x: x >= 0, "zero or positive")
fraction = _check(float, lambda x: 0 <= x <= 1, "between 0 and 1")


def module_command(module: str, *args: str) -> tuple[list[str], dict]:
    """(argv, environment) that run the module `module` of code/ (lecture27.wire) as a program in a fresh
    interpreter: `python -m module args`, with this code/ first on its PYTHONPATH, so that the child runs the
    same files as its parent (the sender of the paced socket speaks the receiver's protocol) even when the
    parent runs from a copy of the project other than the one installed."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), *filter(None,
                                                                                           [env.get("PYTHONPATH")])])
    return [sys.executable, "-m", module, *args], env
