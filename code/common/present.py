"""The page a script writes through: `page.part(...)`, `page.say(...)`, `page.table(...)`, `page.figure(...)`,
`page.exercise(...)`. The page prints as it goes, and at the end (`page.finish`) writes the script's `--json`
and the file `figures/pages/NN.json` the report is built from (`report.py`); a run whose settings differ
from the shipped ones is a what-if, with a folder of its own for its figures. Nothing here computes a
lecture figure.

A script's page module imports all it shows a result with from here: the page, and what this module
re-exports from the three it is built on: a table as data and the handout's figures (table.py), the
table's renderers to terminal text and `--json` (render.py) and a figure as data (charts.py).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from contextlib import contextmanager
from pathlib import Path

from .charts import REFERENCE, Chart, Series, cdf, chart_figure, pyplot, segment_bars
from .render import WIDTH, cell_lines, merge_json, plain, render_text, table_block, table_json, wrap
from .table import (DASH, Col, Field, Handout, Ref, Row, Table, Val, change, cols, fact, grid, handout, handout_text,
                    holds, pct0, pct1, pct2, pick, plural, points, refs, table_of, text_table, why_notes)

__all__ = [  # the page and its helpers, then what it re-exports
    "CACHE_EVENTS", "REPO", "Page", "check_writable_dir", "check_writable_file", "edited", "figures_dir", "run_tag",
    "shown", "value_text", "whatif_banner",
    "REFERENCE", "Chart", "Series", "cdf", "chart_figure", "pyplot", "segment_bars",
    "WIDTH", "cell_lines", "merge_json", "plain", "render_text", "table_block", "table_json", "wrap",
    "DASH", "Col", "Field", "Handout", "Ref", "Row", "Table", "Val", "change", "cols", "fact", "grid", "handout",
    "handout_text", "holds", "pct0", "pct1", "pct2", "pick", "plural", "points", "refs", "table_of", "text_table",
    "why_notes"]

# what this process loaded from the cache and what it computed, one {"name", "loaded", "seconds"} each:
# checkpoints.cached appends to it (as checkpoints.EVENTS), and a page's record keeps it, so the report says
# which results came from code/checkpoints/
CACHE_EVENTS: list[dict] = []


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
