"""What a result looks like on the page. A table is data: its title and handout section, its columns and
rows, our value in each cell with its format, the handout's figure where there is one (with the inputs it
holds for) and the note that explains a difference. From that one structure three renderers make the
aligned text of the terminal, the `--json` keys and the HTML of the report.

A script writes through a `Page`: `page.part(...)`, `page.say(...)`, `page.table(...)`, `page.figure(...)`,
`page.exercise(...)`. The page prints as it goes, and at the end (`page.finish`) writes the script's
`--json` and the file `figures/pages/NN.json` the report is built from (`report.py`). Nothing here
computes a lecture figure.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import textwrap
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

WIDTH = 120          # no printed line is wider
DASH = "-"           # an empty cell: no value, or no handout figure for this run's inputs

# what this process loaded from the cache and what it computed, one {"name", "loaded", "seconds"} each:
# checkpoints.cached appends to it (as checkpoints.EVENTS), and a page's record keeps it, so the report says
# which results came from code/checkpoints/
CACHE_EVENTS: list[dict] = []


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


# ----------------------------------------------------------------------------- output paths
def check_writable_file(path: str | Path) -> str | None:
    """None when `path` can be written (its folder created if need be), else why not, in a few words."""
    p = Path(path)
    if p.is_dir():
        return f"{path} is a folder"
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return f"cannot create the folder {p.parent}: {e.strerror or e}"
    existed = p.exists()
    try:
        with open(p, "a"):
            pass
    except OSError as e:
        return f"cannot write {path}: {e.strerror or e}"
    if not existed:
        p.unlink()
    return None


def check_writable_dir(path: str | Path) -> str | None:
    """None when files can be written in the folder `path` (created if need be), else why not."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        return f"{path} is a file, not a folder"
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return f"cannot create the folder {path}: {e.strerror or e}"
    if not os.access(p, os.W_OK | os.X_OK):
        return f"cannot write in the folder {path}"
    return None


# ----------------------------------------------------------------------------- the page
REPO = Path(__file__).resolve().parents[2]


def shown(path) -> str:
    """A path as a script prints it: relative to the clone's root when inside it, so a line reads (and is
    as wide) the same wherever the clone lies; else as given."""
    p = Path(path)
    try:
        return str(p.resolve().relative_to(REPO))
    except ValueError:
        return str(p)


def figures_dir() -> Path:
    """figures/ at the clone's root, or $L27_FIGURES (the tests draw into a temporary folder)."""
    return Path(os.environ.get("L27_FIGURES", REPO / "figures"))


def edited(settings, defaults) -> dict:
    """The settings a run changed from the script's defaults: name -> value (both frozen dataclasses)."""
    a, b = dataclasses.asdict(settings), dataclasses.asdict(defaults)
    return {k: v for k, v in a.items() if b.get(k) != v}


def run_tag(changes: dict) -> str:
    """A what-if run's folder name: the settings it changed, readable where a value is short ("compression=5";
    a file by its name; a long value, such as a trace, by the setting's name alone), then a digest of every
    changed value, so two runs whose inputs differ never share a folder, however alike their names:
    'compression=5_1f0c2a9b', 'trace+trace_file=mytrace.csv_7d41e0c3'."""
    def readable(k, v):
        text = f"{v:g}" if isinstance(v, float) else Path(v).name if isinstance(v, str) else str(v)
        clean = "".join(ch if ch.isalnum() or ch in ".-_" else "_" for ch in text)
        short = isinstance(v, (str, int, float, bool, type(None))) and 0 < len(clean) <= 24
        return f"{k}={clean}" if short else k
    names = "+".join(readable(k, v) for k, v in sorted(changes.items()))
    if len(names) > 48:
        names = "+".join(sorted(changes))[:48]
    digest = hashlib.sha256(json.dumps(plain(changes), sort_keys=True, default=repr).encode()).hexdigest()[:8]
    return f"{names}_{digest}"


def value_text(v, width: int = 40) -> str:
    """A setting's value as a sentence shows it: a float by its digits, a long value cut at `width`."""
    text = f"{v:g}" if isinstance(v, float) else str(v)
    return text if len(text) <= width else text[:width - 3] + "..."


def whatif_banner(changes: dict, shipped: dict, folder: str) -> str:
    """The sentence a what-if run opens with, on screen and in the report: each setting it changed (a flag
    or an edited constant), its value as shipped, and where the run's figures go."""
    edits = ", ".join(f"{k} = {value_text(v)} (shipped: {value_text(shipped.get(k))})" for k, v in changes.items())
    return (f"What-if: this run's settings differ from the defaults as shipped: {edits}. Its figures go to "
            f"{folder}, and the handout column is blank wherever the handout's figure holds for other inputs.")


class Page:
    """What one script shows, in order: parts, paragraphs, tables, figures, exercises. Each call prints
    at once and keeps a record, so the same page is the terminal output, the `--json` and the report's
    section. A run whose settings differ from the defaults as shipped (`defaults`: cli.shipped_defaults),
    by a flag or by an edited constant, is a what-if: it says so first, and draws its figures into a
    folder of its own under whatif/ (run_tag), so the default figures stay the default's. Its clock starts
    when it is made: a script makes it before it computes, so the report's time for the script counts the
    computing."""

    def __init__(self, script: str, title: str, section: str, settings=None, defaults=None,
                 plot: bool = True, figures: Path | None = None):
        self.script, self.title, self.section = script, title, section
        self.settings = settings
        self.changes = edited(settings, defaults) if settings is not None and defaults is not None else {}
        self.shipped = {k: getattr(defaults, k) for k in self.changes}
        base = Path(figures) if figures is not None else figures_dir()
        self.whatif = f"{script}_{run_tag(self.changes)}" if self.changes else ""
        self.figures = base / "whatif" / self.whatif if self.changes else base
        self.pages = base / "pages"
        self.plot = plot
        self.blocks: list[dict] = []
        self.tables: list[Table] = []
        self.json_extra: list[dict] = []
        if self.changes:   # the folder as one word short enough for a line of its own
            where = (f"{shown(self.figures)}/" if len(shown(self.figures)) < 100 else
                     f"the folder {self.whatif}/ in {shown(base / 'whatif')}/")
            print(wrap(whatif_banner(self.changes, self.shipped, where)))
        self.t0 = time.time()

    # -- writing
    def part(self, name: str, section: str, title: str) -> None:
        """A Part's heading: '== Part 2 (§5.2). Full reuse vs CacheBlend ====='."""
        head = f"\n== {name} ({section}). {title} "
        print(head + "=" * max(3, WIDTH - len(head)))
        self.blocks.append({"kind": "part", "name": name, "section": section, "title": title})

    def exercise(self, n: int, section: str, title: str) -> None:
        """An exercise's heading, 'Exercise N (§x, §10): ...', on screen and in the report."""
        print(wrap(f"\nExercise {n} ({section}, §10): {title}"))
        self.blocks.append({"kind": "exercise", "n": n, "section": section, "title": title})

    def say(self, text: str, indent: int | None = None, code: bool = False) -> None:
        """A paragraph, wrapped to WIDTH; code=True: lines laid out by hand (a request sketch), kept as they
        are and set in a fixed-width font in the report."""
        print(text if code else wrap(text, indent))
        self.blocks.append({"kind": "text", "text": text, **({"code": True} if code else {})})

    def table(self, t: Table) -> Table:
        if self.blocks and self.blocks[-1]["kind"] in ("table", "text"):
            print()  # a blank line between a table and what came before it, unless that was a heading
        print(render_text(t))
        self.blocks.append(table_block(t))
        self.tables.append(t)
        return t

    def texts(self) -> list[str]:
        """Every sentence on the page, as printed: headings, table titles and notes, paragraphs."""
        return [x for b in self.blocks for x in [b.get("title"), b.get("text"), *b.get("notes", [])] if x]

    def data(self, **keys) -> None:
        """`--json` keys that no table holds (for example a setup the headings state)."""
        self.json_extra.append(keys)

    def figure_path(self, name: str) -> Path:
        self.figures.mkdir(parents=True, exist_ok=True)
        return self.figures / name

    @contextmanager
    def figure(self, name: str, title: str = "", figsize=(7, 4.5), ncols: int = 1, nrows: int = 1, **kw):
        """Draw one figure: `with page.figure("04_curve.png", "...") as (fig, ax): ax.plot(...)`. Styled,
        saved under the page's figure folder at 120 dpi, its path printed and kept for the report. With
        plotting off (`--no-plot`) the body is skipped."""
        if not self.plot:
            yield None, None
            return
        plt = pyplot()
        fig, ax = plt.subplots(nrows, ncols, figsize=figsize, **kw)
        try:
            yield fig, ax
            if title:
                fig.suptitle(title, fontsize=10)
            fig.tight_layout()
            path = self.figure_path(name)
            fig.savefig(path, dpi=120)
        finally:
            plt.close(fig)
        self.add_figure(path)

    def add_figure(self, path: Path) -> None:
        print(f"figure: {shown(path)}")
        self.blocks.append({"kind": "figure", "path": str(path)})

    # -- the end
    def json(self) -> dict:
        return merge_json([table_json(t) for t in self.tables] + self.json_extra)

    def finish(self, json_path: str | None = None, cache_events: list | None = None) -> dict:
        """Write `--json` (when asked) and this page's record for the report; return the JSON."""
        data = self.json()
        if json_path:
            Path(json_path).parent.mkdir(parents=True, exist_ok=True)
            Path(json_path).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
            print(f"wrote {shown(json_path)}")
        if cache_events is None:
            cache_events = list(CACHE_EVENTS)
        settings = dataclasses.asdict(self.settings) if dataclasses.is_dataclass(self.settings) else {}
        record = {"script": self.script, "title": self.title, "section": self.section,
                  "settings": plain(settings), "changes": plain(self.changes),
                  "shipped": plain(self.shipped), "whatif": self.whatif, "seconds": time.time() - self.t0,
                  "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
                  "finished_at": time.time(), "cache": cache_events, "blocks": self.blocks}
        try:
            self.pages.mkdir(parents=True, exist_ok=True)
            (self.pages / f"{self.script}.json").write_text(json.dumps(plain(record), indent=1) + "\n")
        except OSError:
            pass  # the report is a convenience; the run's output and --json are what count
        return data


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend, with this project's style."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    plt.rcParams.update({"axes.grid": True, "grid.alpha": 0.3, "axes.titlesize": 10, "legend.fontsize": 8,
                         "figure.dpi": 120})
    return plt


# ----------------------------------------------------------------------------- a figure as data
REFERENCE = {"color": "gray", "ls": ":", "lw": 1}   # how a reference line (chance, a floor) is drawn


@dataclass
class Series:
    """One series of a chart: y over x, its legend label (None: not in the legend), how it is drawn ("line",
    where a y of None leaves a gap; "step": held until the next x, as a trace or a CDF; "bar": side by side
    with the chart's other bar series at category positions x; "barh": one horizontal bar per label x, the
    first on top, each value written at its bar's end with `fmt` when it has one; "scatter") and
    matplotlib's style keywords (color, ls, marker, ...)."""
    x: Any
    y: Any
    label: str | None = None
    kind: str = "line"
    style: dict = field(default_factory=dict)
    fmt: str | None = None


@dataclass(kw_only=True)
class Chart:
    """One panel described by data: its series, axis labels and scales, the handout's range as a grey band
    (lo, hi, label), reference lines across it (hlines at y, vlines at x: (value, style) pairs, the style
    holding the legend's label), the grid's ticks ("major" or "both"), the legend's keywords (None: no
    legend) and any further `ax.set` settings (ylim, xticks, ...)."""
    series: list
    xlabel: str = ""
    ylabel: str = ""
    title: str = ""
    xscale: str = "linear"
    yscale: str = "linear"
    band: tuple | None = None
    hlines: list = field(default_factory=list)
    vlines: list = field(default_factory=list)
    grid: str = "major"
    legend: dict | None = field(default_factory=dict)
    minor_ticks: bool = True
    axes: dict = field(default_factory=dict)


def draw_series(ax, s: Series, bars: list) -> None:
    """Draw one Series on matplotlib axes (`bars`: the chart's "bar" series, which share each category)."""
    if s.kind == "bar":
        i, w = bars.index(s), 0.8 / len(bars)
        ax.bar([x + (i - (len(bars) - 1) / 2) * w for x in s.x], s.y, w, label=s.label, **s.style)
    elif s.kind == "barh":
        ax.barh(s.x, s.y, label=s.label, **s.style)
        for y, v in enumerate(s.y if s.fmt else []):
            ax.text(v, y, s.fmt.format(v), va="center", fontsize=8)
        ax.invert_yaxis()
    elif s.kind == "step":
        ax.step(s.x, s.y, where="post", label=s.label, **s.style)
    elif s.kind == "scatter":
        ax.scatter(s.x, s.y, label=s.label, **s.style)
    else:
        ax.plot(s.x, [math.nan if v is None else v for v in s.y], label=s.label, **s.style)


def draw_chart(ax, c: Chart) -> None:
    """Draw one Chart on matplotlib axes: its series, band and reference lines, then its axes and legend."""
    for s in c.series:
        draw_series(ax, s, [b for b in c.series if b.kind == "bar"])
    if c.band:
        ax.axhspan(c.band[0], c.band[1], color="0.85", label=c.band[2], zorder=0)
    for y, style in c.hlines:
        ax.axhline(y, **style)
    for x, style in c.vlines:
        ax.axvline(x, **style)
    named = dict(xscale=c.xscale, yscale=c.yscale, xlabel=c.xlabel, ylabel=c.ylabel, title=c.title)
    ax.set(**{k: v for k, v in named.items() if v not in ("", "linear")}, **c.axes)  # a linear scale is the default
    ax.grid(alpha=0.3, which=c.grid)
    if not c.minor_ticks:
        ax.minorticks_off()
    if c.legend is not None:
        ax.legend(**c.legend)


def chart_figure(page: Page, name: str, charts: Chart | list[Chart], title: str = "", ncols: int | None = None,
                 **kw) -> None:
    """A figure of one or more Charts, `ncols` panels a row (default: all in one row), drawn and saved through
    `page.figure` (kw: its figsize, sharex, ...); nothing is drawn with plotting off."""
    charts = charts if isinstance(charts, list) else [charts]
    ncols = ncols or len(charts)
    nrows = -(-len(charts) // ncols)
    with page.figure(name, title, nrows=nrows, ncols=ncols, squeeze=False, **kw) as (fig, axes):
        if axes is not None:
            for i, c in enumerate(charts):
                draw_chart(axes[i // ncols][i % ncols], c)


def cdf(values) -> tuple[list, list]:
    """The points of an empirical CDF: the values sorted, and the share of values at or below each."""
    xs = sorted(values)
    return xs, [(i + 1) / len(xs) for i in range(len(xs))]


def segment_bars(page: Page, name: str, bars: dict, colors: dict, xlabel: str, title: str, figsize=(7, 4.5),
                 legend: dict | None = None) -> None:
    """Horizontal bars laid end to end from segments: bars is name -> [(length, text written inside, kind)],
    each segment colored by its kind (colors: kind -> color, one legend entry each)."""
    with page.figure(name, figsize=figsize) as (fig, ax):
        if ax is None:
            return
        from matplotlib.patches import Patch
        for y, segments in enumerate(bars.values()):
            left = 0.0
            for length, text, kind in segments:
                ax.barh(y, length, left=left, color=colors[kind], edgecolor="white")
                ax.text(left + length / 2, y, text, ha="center", va="center", fontsize=6, color="white")
                left += length
        ax.set(yticks=range(len(bars)), yticklabels=list(bars), xlabel=xlabel)
        ax.set_title(title, fontsize=9)
        ax.legend(handles=[Patch(color=c, label=k) for k, c in colors.items()], **(legend or {}))
