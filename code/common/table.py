"""A table as data: its title and handout section, its columns and rows, our value in each cell with its
format, the handout's figure where there is one (with the inputs it holds for) and the note that explains a
difference; tables built from results, and the sentences a note builds from numbers. The renderers that
turn a table into terminal text, `--json` keys and the report's cells are render.py's; the page a script
writes through is present.py's. Nothing here computes a lecture figure.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable

DASH = "-"           # an empty cell: no value, or no handout figure for this run's inputs


# ----------------------------------------------------------------------------- the handout's figures
@dataclass(frozen=True)
class Ref:
    """A figure the handout prints, the inputs it holds for (setting name -> the handout's value), and,
    where ours differs for a reason worth knowing, that reason (shown beside it)."""
    figure: str
    inputs: dict = field(default_factory=dict)
    why: str = ""


class Handout:
    """A script's one reference table of the handout's figures: name -> Ref. Calling it with a name and
    the run's settings gives the Ref when every input it holds for has the handout's value, else None:
    a student's edit blanks the handout column instead of printing a figure for other inputs."""

    def __init__(self, refs: dict[str, Ref], **common_inputs):
        # inputs every figure of the script holds for (for example the bytes per value)
        self.refs = {k: Ref(r.figure, {**common_inputs, **r.inputs}, r.why) for k, r in refs.items()}

    def __call__(self, name: str, settings) -> Ref | None:
        ref = self.refs[name]
        return ref if holds(ref.inputs, settings) else None

    def figure(self, name: str, settings) -> str:
        ref = self(name, settings)
        return ref.figure if ref else DASH


def handout(table: Handout, name: str, settings, **row) -> Ref | str:
    """The one handout lookup every script uses: the Ref of figure `name` in the script's `table` when this
    run's settings have every input it holds for, else DASH (other inputs, or no such figure). `row`: the
    inputs one row of a table changes (its chunk length, its system), laid over the run's settings."""
    if name not in table.refs:
        return DASH
    if row:
        settings = {**(settings if isinstance(settings, dict) else dataclasses.asdict(settings)), **row}
    return table(name, settings) or DASH


def pct0(x) -> str:
    """A share as a whole percentage: 0.123 -> "12%" (None -> DASH)."""
    return DASH if x is None else f"{x:.0%}"


def pct1(x) -> str:
    """A share as a percentage with one decimal: 0.1234 -> "12.3%" (None -> DASH)."""
    return DASH if x is None else f"{x:.1%}"


def pct2(x) -> str:
    """A share as a percentage with two decimals: 0.01234 -> "1.23%" (None -> DASH)."""
    return DASH if x is None else f"{x:.2%}"


def refs(inputs: dict, figures: dict[str, str]) -> dict[str, Ref]:
    """Several of the handout's figures that hold for the same inputs: name -> Ref (for a Handout)."""
    return {name: Ref(figure, inputs) for name, figure in figures.items()}


def holds(inputs: dict, settings) -> bool:
    """True when `settings` (a dataclass or a dict) has each of `inputs`' values."""
    get = settings.get if isinstance(settings, dict) else (lambda k, d=None: getattr(settings, k, d))
    missing = object()
    for k, v in inputs.items():
        have = get(k, missing)
        if have is missing:
            raise KeyError(f"the handout's inputs name {k!r}, which is not a setting")
        if isinstance(v, float) or isinstance(have, float):
            if not (isinstance(have, (int, float)) and math.isclose(have, v, rel_tol=1e-9, abs_tol=1e-12)):
                return False
        elif have != v:
            return False
    return True


# ----------------------------------------------------------------------------- a table as data
Fmt = str | Callable[[Any], str]


@dataclass(frozen=True)
class Col:
    """A column: its header, how a value is written (a format string such as "{:.3f}", or a function),
    and, for `--json`, the key its values go to: "name" gives a list over the rows (in order, rows whose
    value is None left out), "name.{row}" or "configs.{row}.hit_rate" a dict keyed by each row's key,
    "levels[].accuracy" a list with one dict per row (the columns with keys "levels[]..." fill it).
    `scale` multiplies the value written to JSON (for example bytes on screen, GB in JSON: 1e-9). Text
    columns (`left=True`) are aligned left, numbers right; the first column is always left. A `reference`
    column holds figures measured elsewhere (a real GPU's, common/gpu_reference.py), each looked up through
    `handout` like the handout's: the report marks it as it marks the handout's column."""
    header: str
    fmt: Fmt = "{}"
    key: str | None = None
    scale: float | None = None
    left: bool = False
    reference: bool = False


@dataclass
class Val:
    """One cell whose value has a `--json` key of its own (a scalar key of the spec), and optionally a
    format of its own and a different JSON value (for example a figure printed in KiB, stored in bytes)."""
    value: Any
    key: str | None = None
    fmt: Fmt | None = None
    json: Any = None                # None: the JSON value is `value`


@dataclass
class Row:
    cells: list                     # one value per column; a value may be a Val
    handout: Ref | str | None = None  # the handout's figure for this row, when the run's inputs are its
    key: str | None = None          # this row's name in JSON dicts ("{row}" of a column's key)


@dataclass(kw_only=True)
class Table:
    title: str
    section: str                    # the handout's section, for example "§1.2"
    cols: list[Col]
    rows: list[Row]
    source: str = ""                # the function that computed it, "module.function"
    notes: list[str] = field(default_factory=list)  # sentences computed from the result, printed under it
    json: dict = field(default_factory=dict)        # keys this table states in its title or notes

    def has_handout(self) -> bool:
        return any(r.handout is not None for r in self.rows)


def cols(*specs) -> list[Col]:
    """Columns from (header, fmt[, key[, scale]]) tuples or plain headers."""
    return [s if isinstance(s, Col) else Col(s) if isinstance(s, str) else Col(*s) for s in specs]


def fact(label: str, value, key: str | None = None, fmt: Fmt | None = None, handout: Ref | str | None = None) -> Row:
    """One row of a "quantity | ours | handout" table: the label, our value (stored in `--json` under `key`
    when it has one, written with `fmt` when it has its own; or a Val that says both) and the handout's figure
    beside it."""
    return Row([label, value if isinstance(value, Val) else Val(value, key, fmt)], handout)


def fmt_cell(value, fmt: Fmt) -> str:
    if isinstance(value, Val):
        return fmt_cell(value.value, value.fmt or fmt)
    if value is None:
        return DASH
    if isinstance(value, str):
        return value
    return fmt(value) if callable(fmt) else fmt.format(value)


def handout_text(h) -> str:
    if h is None:
        return DASH
    if isinstance(h, Ref):
        return h.figure + (" *" if h.why else "")
    return str(h)


def grid(t: Table) -> tuple[list[str], list[list[str]]]:
    """The table's header and cells as strings, with the handout column last when it has one."""
    headers = [c.header for c in t.cols]
    body = [[fmt_cell(v, c.fmt) for v, c in zip(r.cells, t.cols)] for r in t.rows]
    if t.has_handout():
        headers.append("handout")
        for cells, r in zip(body, t.rows):
            cells.append(handout_text(r.handout))
    return headers, body


def why_notes(t: Table) -> list[str]:
    """The reason beside each handout figure ours differs from, once per reason."""
    seen = []
    for r in t.rows:
        if isinstance(r.handout, Ref) and r.handout.why and r.handout.why not in seen:
            seen.append(r.handout.why)
    return seen


# ----------------------------------------------------------------------------- tables built from results
def pick(item, get):
    """The value `get` names in `item`: a function of it, an index (of a tuple), or a dotted path of
    attributes and dict keys ("adaptive.ttft_s", "layout.layers", "ttft.level0")."""
    if callable(get):
        return get(item)
    if isinstance(get, int):
        return item[get]
    for name in get.split("."):
        item = item[name] if isinstance(item, dict) else getattr(item, name)
    return item


@dataclass(frozen=True)
class Field(Col):
    """A column that reads each row's value from that row's result: `get` names it as `pick` reads it (a
    field "hit_rate", a dotted path, an index, a function of the result), or is a dict keyed by the row's
    name; None shows the row's name."""
    get: str | int | Callable | dict | None = None

    def of(self, name, result):
        if self.get is None:
            return name
        if isinstance(self.get, dict):
            return self.get[name]
        return pick(result, self.get)


def table_of(title: str, section: str, fields: list[Field], results, source: str = "", notes=(), json=None,
             handout=None) -> Table:
    """A table with one row per result, each cell read by its Field. `results` is a dict name -> result (the
    name is the row's JSON key, "{row}"; a row named None states none) or a list; `handout` is every row's
    handout figure, a function of the result that gives it, or a dict keyed by the row's name."""
    items = results.items() if isinstance(results, dict) else [(None, r) for r in results]
    ref = lambda name, r: handout[name] if isinstance(handout, dict) else handout(r) if callable(handout) else handout
    rows = [Row([f.of(name, r) for f in fields], ref(name, r), name) for name, r in items]
    return Table(title=title, section=section, cols=list(fields), rows=rows, source=source, notes=list(notes),
                 json=dict(json or {}))


def points(result, fields: list[Field]) -> list[dict]:
    """One result whose fields are lists over the same points (a sweep over k chunks, over ratios) as one
    dict per point, for `table_of`: point i holds item i of the list each Field names (a field's name each)."""
    return [dict(zip([f.get for f in fields], cells)) for cells in zip(*(pick(result, f.get) for f in fields))]


def text_table(title: str, section: str, headers: list[str], rows, source: str = "") -> Table:
    """A table of given text (the slides' benchmarks, a mapping), no values of ours: one Row per tuple."""
    return Table(title=title, section=section, cols=cols(*headers), rows=[Row(list(r)) for r in rows], source=source)


# ----------------------------------------------------------------------------- sentences from numbers
def change(before, after, fmt: str = "{}") -> str:
    """How a figure moved, in the words its printed values allow: 'rises (a -> b)', 'falls (a -> b)', or
    'stays at a' when both print the same. A sentence built on it cannot say "rises (0% -> 0%)"."""
    a, b = fmt.format(before), fmt.format(after)
    if a == b:
        return f"stays at {a}"
    return f"{'rises' if after > before else 'falls'} ({a} -> {b})"


def plural(n: int, word: str, fmt: str = "{:,}") -> str:
    """'1 stream', '3 streams': a count and its noun."""
    return f"{fmt.format(n)} {word}{'s' * (n != 1)}"
