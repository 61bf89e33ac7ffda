"""What every numbered script shares: argument parsing with one-line errors, the output paths checked
before any work starts, and the frozen settings object a script builds from its constants and the command
line. Tables, figures and `--json` are common/present.py's. Nothing here computes a lecture figure."""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import textwrap
from pathlib import Path

from .present import check_writable_dir, check_writable_file, figures_dir


class Parser(argparse.ArgumentParser):
    """argparse with a one-line error and exit code 2 (no usage dump, no traceback)."""

    def __init__(self, doc: str, json: bool = True, **kw):
        # the module docstring's first paragraph is the description
        super().__init__(description=doc.strip().split("\n\n")[0],
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter, **kw)
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


def settings_from(cls, ns: argparse.Namespace, **more):
    """The frozen settings dataclass `cls` with each field taken from the parsed command line (a field
    the command line has no flag for keeps its default, the script's constant), or from `more`."""
    names = {f.name for f in dataclasses.fields(cls)}
    values = {k: v for k, v in vars(ns).items() if k in names}
    return cls(**{**values, **more})


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
positive_float = _check(float, lambda x: x > 0, "positive")
nonneg_float = _check(float, lambda x: x >= 0, "zero or positive")
fraction = _check(float, lambda x: 0 <= x <= 1, "between 0 and 1")


def table(headers: list[str], rows: list[list], title: str | None = None) -> str:
    """Aligned text table. Cells are printed with str(); format numbers before passing them.
    The first column is left-aligned, the others right-aligned."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))

    out = [title] if title else []
    out += [line(cells[0]), "  ".join("-" * w for w in widths)] + [line(r) for r in cells[1:]]
    return "\n".join(out)


WIDTH = 120  # no printed line is wider


def say(text: str, indent: int | None = None) -> None:
    """Print a paragraph wrapped at WIDTH characters; continuation lines indented by `indent` (default: the
    paragraph's own indent + 4)."""
    lead = len(text) - len(text.lstrip(" "))
    print(textwrap.fill(text, WIDTH, subsequent_indent=" " * (lead + 4 if indent is None else indent),
                        break_long_words=False, break_on_hyphens=False))


def figure_path(name: str) -> Path:
    """figures/<name>, folder created on demand."""
    figures_dir().mkdir(parents=True, exist_ok=True)
    return figures_dir() / name


def write_json(path: str | None, data: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        print(f"wrote {path}")
