"""A table's two renderers: aligned text for the terminal, no line wider than WIDTH (with the report's
copy of the same cells), and the `--json` keys its columns and cells name. The table itself is table.py's.
"""
from __future__ import annotations

import dataclasses
import textwrap

from .table import Ref, Table, Val, grid, why_notes

WIDTH = 120          # no printed line is wider


# ----------------------------------------------------------------------------- renderer 1: text
MIN_COL = 10         # a column narrowed to fit WIDTH keeps at least this many characters


def render_text(t: Table) -> str:
    """The table as aligned text, no line wider than WIDTH: a cell too wide for it (a schedule, a list of
    names) wraps within its column, the row's other cells on its first line; `--json` holds the whole value."""
    headers, body = grid(t)
    widths = column_widths([headers, *body])
    left = [i == 0 or (i < len(t.cols) and t.cols[i].left) for i in range(len(widths))]

    def lines(r):
        parts = [cell_lines(c, w) for c, w in zip(r, widths)]
        return ["  ".join((p[k] if k < len(p) else "").ljust(w) if lft else (p[k] if k < len(p) else "").rjust(w)
                          for p, w, lft in zip(parts, widths, left)).rstrip() for k in range(max(map(len, parts)))]

    out = [wrap(t.title)] if t.title else []
    out += [*lines(headers), "  ".join("-" * w for w in widths)] + [ln for r in body for ln in lines(r)]
    out += [wrap("  " + n) for n in t.notes]
    out += [wrap(f"  * handout: {w}") for w in why_notes(t)]
    return "\n".join(out)


def column_widths(rows: list[list[str]]) -> list[int]:
    """Each column as wide as its widest cell; when a line would then pass WIDTH, the widest columns are
    narrowed, to one width, until it fits or they are as narrow as the next widest (then those join them);
    none below MIN_COL."""
    widths = [max(map(len, col)) for col in zip(*rows)]
    room = WIDTH - 2 * (len(widths) - 1)
    while sum(widths) > room and max(widths) > MIN_COL:
        top = max(widths)
        widest = [i for i, w in enumerate(widths) if w == top]
        rest = [w for w in widths if w < top]
        narrower = max((room - sum(rest)) // len(widest), max(rest, default=0), MIN_COL)
        for i in widest:
            widths[i] = narrower
    return widths


def cell_lines(text: str, width: int) -> list[str]:
    """A cell's text in lines of at most `width` characters: broken after ", " (a list's items stay whole), else
    at a space, a word longer than `width` cut. Joined with single spaces, the lines give the text back."""
    if len(text) <= width:
        return [text]
    items = text.split(", ")
    words = []
    for item in [x + "," for x in items[:-1]] + items[-1:]:
        words += [item] if len(item) <= width else textwrap.wrap(item, width, break_on_hyphens=False)
    out = []
    for w in words:
        if out and len(out[-1]) + 1 + len(w) <= width:
            out[-1] += " " + w
        else:
            out.append(w)
    return out


def wrap(text: str, indent: int | None = None) -> str:
    """A paragraph wrapped at WIDTH; continuation lines indented by `indent` (default: its own + 4).
    Lines of a multi-line text are wrapped one by one."""
    out = []
    for para in text.split("\n"):
        lead = len(para) - len(para.lstrip(" "))
        out.append(textwrap.fill(para, WIDTH, subsequent_indent=" " * (lead + 4 if indent is None else indent),
                                 break_long_words=False, break_on_hyphens=False) if para.strip() else "")
    return "\n".join(out)


def table_block(t: Table) -> dict:
    """The table as the report keeps it: its cells as printed, the handout column and any reference column
    marked, the rows whose handout figure differs from ours marked, with the reasons (report.table_html lays
    it out)."""
    headers, body = grid(t)
    return {"kind": "table", "title": t.title, "section": t.section, "source": t.source, "headers": headers,
            "rows": body, "notes": t.notes, "why": why_notes(t), "handout_col": t.has_handout(),
            "reference_cols": [i for i, c in enumerate(t.cols) if c.reference],
            "differs": [isinstance(r.handout, Ref) and bool(r.handout.why) for r in t.rows]}


# ----------------------------------------------------------------------------- renderer 2: --json
def plain(x):
    """Numbers, strings, lists and dicts only: numpy and torch scalars and arrays become Python ones, tuples
    lists, dataclasses dicts, keys strings. What `--json` and a page's record are written as, and the plain
    data a cached result is stored as (checkpoints.cached_result; what a later run loads back)."""
    if isinstance(x, dict):
        return {str(k): plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    if hasattr(x, "tolist"):
        return x.tolist()
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return plain(dataclasses.asdict(x))
    return x


def _put(out: dict, path: str | list, value) -> None:
    """Set out[a][b][c] for the path "a.b.c" (or the list [a, b, c], whose parts may hold dots)."""
    *heads, last = path.split(".") if isinstance(path, str) else path
    d = out
    for h in heads:
        d = d.setdefault(h, {})
    if last in d and d[last] != value:
        raise ValueError(f"--json key {path!r} written twice with different values")
    d[last] = value


def _scaled(v, scale):
    return v * scale if scale is not None and v is not None else v


def table_json(t: Table) -> dict:
    """The `--json` keys of one table: its columns' keys over the rows, its cells' own keys, its extras."""
    out: dict = {}
    for j, c in enumerate(t.cols):
        if c.key is None:
            continue
        values = [(r, r.cells[j].value if isinstance(r.cells[j], Val) else r.cells[j]) for r in t.rows]
        if "[]." in c.key:
            name, sub = c.key.split("[].", 1)
            for d, (_, v) in zip(out.setdefault(name, [{} for _ in values]), values):
                d[sub] = plain(_scaled(v, c.scale))
        elif "{row}" in c.key:
            for r, v in values:
                if r.key is not None:
                    # a row's key may hold dots (a model named "llama-3.1-8b"): it stays one part of the path
                    _put(out, [p.replace("{row}", r.key) for p in c.key.split(".")], plain(_scaled(v, c.scale)))
        else:
            _put(out, c.key, [plain(_scaled(v, c.scale)) for _, v in values if v is not None])
    for r in t.rows:
        for c, v in zip(t.cols, r.cells):
            if isinstance(v, Val) and v.key:
                _put(out, v.key, plain(v.value if v.json is None else v.json))
    for k, v in t.json.items():
        _put(out, k, plain(v))
    return out


def merge_json(parts: list[dict]) -> dict:
    out: dict = {}

    def merge(dst, src, prefix=""):
        for k, v in src.items():
            if isinstance(v, dict) and isinstance(dst.get(k), dict):
                merge(dst[k], v, prefix + k + ".")
            elif k in dst and dst[k] != v:
                raise ValueError(f"--json key {prefix + k!r} written twice with different values")
            else:
                dst[k] = v
    for p in parts:
        merge(out, p)
    return out
