"""figures/report.html: one self-contained page with every table of the lecture beside the handout's figure,
every figure next to its table and every exercise in its section, built from what the scripts saved
(figures/pages/NN.json, written by present.Page.finish). Opens offline in any browser: the figures are
embedded, the page loads nothing.

    python code/lecture27/run_all.py --report     # rebuild it from the saved pages, running nothing
"""
from __future__ import annotations

import base64
import html
import json
import os
import platform
import re
import time
from importlib import metadata
from pathlib import Path

from .present import value_text, whatif_banner

# the handout's order: §1, §3, §4, §5, §6-7, each real-model section right after the section it extends
ORDER = ["01", "02", "02_smollm2", "03", "04", "04_smollm2", "05", "05_smollm2"]

CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0 auto; max-width: 1240px;
       padding: 0 16px 48px; color: #1d1d1f; line-height: 1.45; font-size: 15px; }
header { border-bottom: 2px solid #444; margin-bottom: 12px; }
h1 { font-size: 24px; margin: 16px 0 4px; } h2 { font-size: 20px; margin: 36px 0 6px; border-bottom: 1px solid #bbb; }
h3 { font-size: 16px; margin: 22px 0 6px; } h3.exercise { color: #7a3e00; }
.facts { font-size: 13px; color: #333; } .facts td { padding: 1px 10px 1px 0; vertical-align: top; }
p.whatif { background: #fff3cd; border: 1px solid #e0c36a; padding: 6px 10px; margin: 8px 0; font-size: 14px; }
.pair { display: flex; flex-wrap: wrap; gap: 18px; align-items: flex-start; margin: 10px 0 16px; }
/* a table keeps its natural width: a figure that does not fit beside it goes below, never squeezes it */
.tbls { flex: 0 1 auto; min-width: 0; max-width: 100%; } .tbl { overflow-x: auto; margin-bottom: 12px; }
.figs { flex: 0 1 540px; max-width: 100%; } .figs img { width: 100%; height: auto; border: 1px solid #ddd; }
table.data { border-collapse: collapse; font-size: 13px; font-variant-numeric: tabular-nums; }
p.ttl { font-weight: 600; font-size: 13px; margin: 0 0 4px; white-space: pre-wrap; }
table.data th, table.data td { border-bottom: 1px solid #e4e4e4; padding: 2px 8px; text-align: right;
                               white-space: nowrap; }
table.data th:first-child, table.data td:first-child { text-align: left; white-space: normal; }
table.prose th, table.prose td { white-space: normal; text-align: left; }
table.data th { background: #f3f3f3; } td.handout { background: #eef5ff; }
tr.differs td.handout { background: #ffe9d6; } td.reference { background: #eef8ee; }
.src { font-size: 12px; color: #666; } .src code { font-size: 12px; }
.note { font-size: 13px; margin: 2px 0; } .why { font-size: 13px; margin: 2px 0; color: #8a3b00; }
p.text { margin: 4px 0; white-space: pre-wrap; }
/* the navigation stays on screen; a heading it jumps to is not hidden under it */
nav { position: sticky; top: 0; z-index: 10; background: #fff; font-size: 14px; padding: 6px 0;
      border-bottom: 1px solid #bbb; } nav a { margin-right: 10px; white-space: nowrap; }
nav a.whatif { background: #fff3cd; } [id] { scroll-margin-top: 64px; }
h2 a.top { font-size: 12px; font-weight: normal; margin-left: 10px; }
pre.code { font-size: 13px; margin: 4px 0; overflow-x: auto; }
code { background: #f4f4f4; padding: 0 3px; }
"""


def load_pages(pages_dir: Path) -> dict[str, dict]:
    pages = {}
    for p in sorted(Path(pages_dir).glob("*.json")):
        try:
            rec = json.loads(p.read_text())
            pages[rec["script"]] = rec
        except (OSError, ValueError, KeyError):
            continue  # a page that cannot be read is left out and said in the header
    return pages


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def version(pkg: str) -> str:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return "not installed"


def esc(s) -> str:
    return html.escape(str(s))


def image_tag(path: str) -> str:
    p = Path(path)
    try:
        data = base64.b64encode(p.read_bytes()).decode()
    except OSError:
        return f'<p class="why">figure missing: {esc(p.name)}</p>'
    return f'<img alt="{esc(p.name)}" src="data:image/png;base64,{data}">'


def table_html(b: dict) -> str:
    """One table block as HTML: caption, header, rows (the handout's column marked, a differing figure
    marked and its reason beside it; a reference column, a real GPU's measurements, marked too), notes, and
    the function that computed it."""
    n = len(b["headers"])
    head = "".join(f"<th>{esc(h)}</th>" for h in b["headers"])
    rows = []
    for r, differs in zip(b["rows"], b.get("differs", [False] * len(b["rows"]))):
        cells = [f'<td class="handout">{esc(c)}</td>' if b.get("handout_col") and i == n - 1 else
                 f'<td class="reference">{esc(c)}</td>' if i in b.get("reference_cols", []) else f"<td>{esc(c)}</td>"
                 for i, c in enumerate(r)]
        rows.append('<tr class="differs">' if differs else "<tr>")
        rows.append("".join(cells) + "</tr>")
    prose = any(len(str(c)) > 40 for r in b["rows"] for c in r[1:])  # sentences in the cells: let them wrap
    # the title above the table, not its caption: a caption is only as wide as a narrow table
    parts = [f'<p class="ttl">{esc(b["title"])}</p>' if b["title"] else "",
             f'<table class="data{" prose" if prose else ""}"><thead><tr>{head}</tr></thead>'
             f'<tbody>{"".join(rows)}</tbody></table>']
    parts += [f'<p class="note">{esc(t)}</p>' for t in b.get("notes", [])]
    parts += [f'<p class="why">* where ours differs from the handout: {esc(w)}</p>' for w in b.get("why", [])]
    src = f'{esc(b.get("section", ""))}' + (f' &middot; computed by <code>{esc(b["source"])}</code>'
                                            if b.get("source") else "")
    parts.append(f'<p class="src">{src}</p>')
    return "".join(parts)


def label(rec: dict) -> str:
    """A section's name in the navigation: its handout section, and the model for a real-model run."""
    return rec["section"] + (" on SmolLM2" if rec["script"].endswith("_smollm2") else "")


def whatif_text(rec: dict) -> str:
    """The what-if banner of a saved page (a page saved without the shipped values still names its edits)."""
    folder = f"figures/whatif/{rec['whatif']}/" if rec.get("whatif") else "figures/whatif/"
    return whatif_banner(rec["changes"], rec.get("shipped", {}), folder)


def in_exercise_order(blocks: list[dict]) -> list[dict]:
    """The blocks with each run of exercises next to one another (an exercise's heading and what follows it
    up to the next heading) laid out by exercise number, as the handout's §10 lists them."""
    out, i = [], 0
    while i < len(blocks):
        if blocks[i]["kind"] != "exercise":
            out.append(blocks[i])
            i += 1
            continue
        groups = []
        while i < len(blocks) and blocks[i]["kind"] == "exercise":
            j = i + 1
            while j < len(blocks) and blocks[j]["kind"] not in ("part", "exercise"):
                j += 1
            groups.append(blocks[i:j])
            i = j
        out += [b for g in sorted(groups, key=lambda g: g[0]["n"]) for b in g]
    return out


def section_html(rec: dict, anchors: set) -> str:
    """One script's section. `anchors`: the exercise anchors taken by the sections before it; an exercise
    that another section answers first (02 --model smollm2's exercise 3) gets the script in its anchor."""
    out = [f'<h2 id="s{esc(rec["script"])}">{esc(rec["section"])} &middot; {esc(rec["title"])}'
           f'<a class="top" href="#top">back to the top</a></h2>']
    if rec.get("changes"):
        out.append(f'<p class="whatif">{esc(whatif_text(rec))}</p>')
    blocks, i = in_exercise_order(rec["blocks"]), 0
    while i < len(blocks):
        b = blocks[i]
        if b["kind"] == "part":
            out.append(f'<h3>{esc(b["name"])} ({esc(b["section"])}). {esc(b["title"])}</h3>')
        elif b["kind"] == "exercise":
            anchor = f'ex{b["n"]}' if f'ex{b["n"]}' not in anchors else f'ex{b["n"]}-{esc(rec["script"])}'
            anchors.add(anchor)
            out.append(f'<h3 class="exercise" id="{anchor}">Exercise {b["n"]} ({esc(b["section"])}, §10): '
                       f'{esc(b["title"])}</h3>')
        elif b["kind"] == "text":
            out.append(f'<pre class="code">{esc(b["text"].strip(chr(10)))}</pre>' if b.get("code") else
                       f'<p class="text">{esc(b["text"].strip())}</p>')
        elif b["kind"] in ("table", "figure"):
            # a table and the figures right after it sit side by side
            tables, figs = [], []
            while i < len(blocks) and blocks[i]["kind"] == "table" and not figs:
                tables.append(blocks[i])
                i += 1
            while i < len(blocks) and blocks[i]["kind"] == "figure":
                figs.append(blocks[i])
                i += 1
            tbl = "".join(f'<div class="tbl">{table_html(t)}</div>' for t in tables)
            fig = "".join(f'<p>{image_tag(f["path"])}</p>' for f in figs)
            out.append(f'<div class="pair"><div class="tbls">{tbl}</div>'
                       + (f'<div class="figs">{fig}</div>' if figs else "") + '</div>')
            continue
        i += 1
    return "\n".join(out)


def header_html(pages: dict[str, dict], order: list[str], missing: list[str], since: float | None) -> str:
    """The facts of the run (machine, software, seeds, each script's time, what was loaded and what was
    computed, the what-if sections) and the page's title. `since`: when this run began; the pages saved
    before it are an earlier run's, and what they computed is not this run's (None: every page is)."""
    facts = [("built", time.strftime("%Y-%m-%d %H:%M")),
             ("machine", f"{cpu_name()}, {os.cpu_count()} cores, {platform.system()} {platform.release()}"),
             ("software", f"Python {platform.python_version()}, torch {version('torch')}, numpy {version('numpy')}")]
    seeds = sorted({f"{k} = {v}" for r in pages.values() for k, v in r.get("settings", {}).items() if "seed" in k})
    if seeds:
        facts.append(("seeds", ", ".join(seeds)))
    runs = [f"{r['script']}: {r['seconds']:.1f} s (finished {r.get('finished', '?')})"
            for r in (pages[s] for s in order)]
    facts.append(("each script's time", "; ".join(runs)))
    now = [r for r in pages.values() if since is None or r.get("finished_at", 0) >= since]
    events = [(f"{e['name']} ({r['script']})", e.get("loaded")) for r in now for e in r.get("cache", [])]
    computed = [name for name, was_loaded in events if not was_loaded]   # (read back after: still computed)
    loaded = [name for name, was_loaded in events if was_loaded and name not in computed]
    facts.append(("loaded from code/checkpoints/", ", ".join(dict.fromkeys(loaded)) or "nothing"))
    facts.append(("computed in this run", ", ".join(dict.fromkeys(computed)) or "nothing"))
    if since is not None and len(now) < len(pages):
        earlier = [s for s in order if pages[s] not in now]
        facts.append(("saved by an earlier run", ", ".join(earlier) + " (this run ran "
                      + (", ".join(s for s in order if pages[s] in now) or "nothing") + ")"))
    if missing:
        facts.append(("not run yet", ", ".join(missing)))
    rows = "".join(f"<tr><td><b>{esc(k)}</b></td><td>{esc(v)}</td></tr>" for k, v in facts)
    whatifs = [s for s in order if pages[s].get("changes")]
    listed = "; ".join(f'<a href="#s{esc(s)}">{esc(label(pages[s]))} ({esc(s)})</a>: '
                       + esc(", ".join(f"{k} = {value_text(v)}" for k, v in pages[s]["changes"].items())
                             + (f" (figures/whatif/{pages[s]['whatif']}/)" if pages[s].get("whatif") else ""))
                       for s in whatifs)
    rows += (f'<tr><td><b>what-if sections</b></td><td>{listed or "none: every section ran the defaults as shipped"}'
             '</td></tr>')
    return (f'<header id="top"><h1>Lecture 27: KV cache as data (CacheGen, CacheBlend, LMCache)</h1>'
            f'<p>Every table the scripts print, our figure beside the handout\'s; a row marked * differs from the '
            f'handout, with the reason beside it. Each table names the function that computed it. A section marked '
            f'what-if ran settings other than the defaults as shipped.</p><table class="facts">{rows}</table></header>')


def nav_html(pages: dict[str, dict], order: list[str], extra_html: str) -> str:
    """The navigation bar, kept on screen: every section (what-if sections marked), every exercise in
    number order, and the closing sections of `extra_html` (its <h2 id=...> headings)."""
    links = [f'<a href="#s{esc(s)}"' + (' class="whatif"' if pages[s].get("changes") else "")
             + f'>{esc(label(pages[s]))}' + (" (what-if)" if pages[s].get("changes") else "") + "</a>" for s in order]
    exercises = sorted({b["n"] for r in pages.values() for b in r["blocks"] if b["kind"] == "exercise"})
    links += [f'<a href="#ex{n}">ex. {n}</a>' for n in exercises]
    links += [f'<a href="#{i}">{t}</a>' for i, t in re.findall(r'<h2 id="([^"]+)">(.*?)</h2>', extra_html)]
    return f'<nav><a href="#top">top</a> {" ".join(links)}</nav>'


def build_report(pages_dir: Path, out: Path, extra_html: str = "", since: float | None = None) -> Path:
    """Write the report from the saved pages (and `extra_html`, a closing section) to `out`. `since`: when
    this run began (run_all.py --report, which runs nothing, gives the time of the rebuild)."""
    pages = load_pages(pages_dir)
    order = [s for s in ORDER if s in pages] + sorted(s for s in pages if s not in ORDER)
    missing = [s for s in ORDER if s not in pages]
    anchors: set = set()
    body = "\n".join(section_html(pages[s], anchors) for s in order)
    doc = (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
           f'<meta name="viewport" content="width=device-width, initial-scale=1">'
           f'<title>Lecture 27 report</title><style>{CSS}</style></head><body>'
           f'{header_html(pages, order, missing, since)}{nav_html(pages, order, extra_html)}\n{body}\n{extra_html}'
           f'</body></html>\n')
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(doc)
    return out
