"""The report (common/report.py) built from saved pages: every table, figure and exercise of the pages is
in it, every embedded image decodes, a what-if run is flagged, and a headless Chromium (Debian's
`chromium`) loads it without errors, renders every image and shows nothing wider than 1280 px."""
import base64
import io
import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass

import matplotlib.image
import pytest

from common import report
from common.present import Col, Handout, Page, Ref, Row, Table, render_text, run_tag


@dataclass(frozen=True)
class Settings:
    context: int = 32
    seed: int = 0


HANDOUT = Handout({"kv": Ref("10.7 GB", {"context": 32}), "bw": Ref("14.4 Gb/s", {}, why="bytes of 16,000")})


def make_page(tmp, script, settings, title="KV size"):
    page = Page(script, f"the ledger {script}", "§1", settings, Settings(), figures=tmp)
    page.part("Part 1", "§1.2", title)
    page.say("a paragraph that explains")
    page.table(Table(title=title, section="§1.2", cols=[Col("quantity"), Col("ours", "{:.2f}", "ours")],
                     rows=[Row(["KV", 10.74], HANDOUT("kv", settings)), Row(["bandwidth", 14.8], HANDOUT("bw",
                                                                                                         settings))],
                     source="ledger.kv_bytes", notes=["a note computed from the rows"]))
    with page.figure(f"{script}_size.png", "KV size") as (fig, ax):
        ax.plot([1, 2, 3], [1, 4, 9])
    page.exercise(1, "§1.2", "how big is a context")
    page.table(Table(title="Exercise 1", section="§1.2", cols=[Col("quantity"), Col("ours")], rows=[Row(["KV bytes",
                                                                                                         "327,680 B"])],
                     source="ledger.kv_bytes"))
    page.finish()
    return page


@pytest.fixture
def built(tmp_path):
    make_page(tmp_path, "01", Settings())
    make_page(tmp_path, "04", Settings(context=6), title="Deviation")
    out = report.build_report(tmp_path / "pages", tmp_path / "report.html", "<h2>Going further</h2>")
    return out, out.read_text()


def test_every_table_figure_and_exercise_is_in_the_report(built):
    path, doc = built
    for title in ("KV size", "Deviation", "Exercise 1", "Going further"):
        assert title in doc
    assert doc.count('<h3 class="exercise"') == 2
    ids = re.findall(r' id="([^"]+)"', doc)                 # both pages answer exercise 1: one anchor each,
    assert len(ids) == len(set(ids)) and 'href="#ex1"' in doc and 'id="ex1"' in doc   # the nav's to the first
    assert "computed by <code>ledger.kv_bytes</code>" in doc
    images = re.findall(r'src="data:image/png;base64,([^"]+)"', doc)
    assert len(images) == 2
    for data in images:
        pixels = matplotlib.image.imread(io.BytesIO(base64.b64decode(data)), format="png")
        assert pixels.shape[0] > 100 and pixels.shape[1] > 100
    assert "<script" not in doc and "http" not in doc.split("</style>")[0]  # loads nothing


def test_handout_column_marks_differences_and_what_if_runs(built):
    _, doc = built
    assert doc.count('<tr class="differs">') == 2          # the 14.4 Gb/s row of each page
    assert "bytes of 16,000" in doc
    sec01, sec04 = doc.split('id="s01"')[1].split('id="s04"')
    assert "10.7 GB" in sec01 and "10.7 GB" not in sec04  # context 6 is not the handout's input
    assert 'class="whatif"' in sec04 and 'class="whatif"' not in sec01


def test_what_if_figures_do_not_overwrite_the_defaults(tmp_path):
    make_page(tmp_path, "01", Settings())
    make_page(tmp_path, "01", Settings(context=6))
    assert (tmp_path / "01_size.png").exists()
    assert (tmp_path / "whatif" / f"01_{run_tag({'context': 6})}" / "01_size.png").exists()
    rec = json.loads((tmp_path / "pages" / "01.json").read_text())
    assert rec["changes"] == {"context": 6} and rec["settings"]["seed"] == 0 and rec["shipped"] == {"context": 32}
    assert rec["whatif"] == f"01_{run_tag({'context': 6})}"


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

# run inside the page after load: errors seen, images not rendered, widest element beyond 1280 px
PROBE = """<script>
window.__errors = [];
window.addEventListener('error', e => window.__errors.push(String(e.message || e.target && e.target.src)), true);
window.addEventListener('load', () => {
  const bad = [...document.images].filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.alt);
  // an element past 1280 px that no scrolling box of its own holds (a wide table may scroll in its box)
  const held = e => { for (let p = e.parentElement; p; p = p.parentElement)
                        if (getComputedStyle(p).overflowX !== 'visible') return true; return false; };
  const wide = [...document.querySelectorAll('body *')].filter(e => e.getBoundingClientRect().right > 1281 && !held(e))
                 .map(e => e.tagName + '.' + e.className).slice(0, 5);
  const out = {errors: window.__errors, images: document.images.length, unrendered: bad,
               scrollWidth: document.documentElement.scrollWidth, wide: wide};
  document.body.setAttribute('data-probe', JSON.stringify(out));
});
</script>"""


def browser_probe(html_path, tmp_path):
    """Open a copy of the report with PROBE in headless Chromium at 1280 px and read PROBE's verdict."""
    probed = tmp_path / "probed.html"
    probed.write_text(html_path.read_text().replace("<head>", "<head>" + PROBE, 1))
    dom = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--window-size=1280,2000",
                          "--virtual-time-budget=5000", "--dump-dom", probed.as_uri()],
                         capture_output=True, text=True, timeout=120).stdout
    m = re.search(r"data-probe=\"([^\"]*)\"", dom)
    assert m, "the page never finished loading in Chromium"
    return json.loads(m.group(1).replace("&quot;", '"').replace("&amp;", "&"))


def report_in_browser(path, tmp_path):
    if not CHROMIUM:
        pytest.skip("no Chromium on this machine (apt-get install chromium): the report's browser check is skipped")
    probe = browser_probe(path, tmp_path)
    assert probe["errors"] == []
    assert probe["images"] > 0 and probe["unrendered"] == []
    assert probe["scrollWidth"] <= 1280 and probe["wide"] == [], probe


@pytest.mark.browser
def test_report_opens_in_a_real_browser(built, tmp_path):
    report_in_browser(built[0], tmp_path)


def test_the_header_says_what_was_computed_and_what_loaded(tmp_path):
    """A result a script computed and then read back from its file is computed, not also loaded."""
    page = Page("02", "the codec", "§3", Settings(), Settings(), figures=tmp_path)
    page.finish(cache_events=[{"name": "records", "loaded": False, "seconds": 50.0},
                              {"name": "records", "loaded": True, "seconds": 50.0},
                              {"name": "codec", "loaded": True, "seconds": 25.0}])
    doc = report.build_report(tmp_path / "pages", tmp_path / "report.html").read_text()
    fact = lambda name: re.search(rf"<b>{re.escape(name)}</b></td><td>(.*?)</td>", doc).group(1)  # noqa: E731
    assert fact("loaded from code/checkpoints/") == "codec (02)"
    assert fact("computed in this run") == "records (02)"


def test_sections_follow_the_handout_and_the_handout_column_is_the_last(tmp_path):
    """Each real-model section right after the section it extends, whatever order the pages were saved in."""
    for script in ["05", "04_smollm2", "05_smollm2", "03", "02_smollm2", "04", "01", "02"]:
        make_page(tmp_path, script, Settings())
    doc = report.build_report(tmp_path / "pages", tmp_path / "report.html").read_text()
    body = doc.split("</nav>")[1]
    assert re.findall(r'<h2 id="s([^"]+)"', body) == ["01", "02", "02_smollm2", "03", "04", "04_smollm2", "05",
                                                       "05_smollm2"]
    nav = doc.split("<nav>")[1].split("</nav>")[0]
    assert re.findall(r'href="#s([^"]+)"', nav) == report.ORDER
    assert '<a href="#s02_smollm2">§1 on SmolLM2</a>' in nav and '<a href="#s04">§1</a>' in nav
    html = report.table_html({"title": "", "headers": ["q", "ours", "handout"], "rows": [["a", "1", "2"]],
                              "handout_col": True, "differs": [False]})
    assert '<td>a</td><td>1</td><td class="handout">2</td>' in html


def test_exercises_are_laid_out_in_order(tmp_path):
    """A page that answers exercise 10 before exercise 9 (each with what follows it) shows 9 first, each
    heading with its own table; the parts around them stay where they are."""
    page = Page("05", "LMCache", "§6-7", Settings(), Settings(), figures=tmp_path)
    page.part("Part 3", "§7", "the narrow waist")
    page.exercise(10, "§7", "the hint")
    page.table(Table(title="ten", section="§7", cols=[Col("q")], rows=[Row(["hint table"])]))
    page.exercise(9, "§6.1", "the service")
    page.table(Table(title="nine", section="§6.1", cols=[Col("q")], rows=[Row(["service table"])]))
    page.part("Part 4", "§5.1", "RAG")
    page.finish()
    doc = report.build_report(tmp_path / "pages", tmp_path / "report.html").read_text()
    order = [doc.index(x) for x in ("Part 3 (§7)", 'id="ex9"', "service table", 'id="ex10"', "hint table",
                                    "Part 4 (§5.1)")]
    assert order == sorted(order)
    nav = doc.split("<nav>")[1].split("</nav>")[0]
    assert nav.index('href="#ex9"') < nav.index('href="#ex10"')


def test_the_navigation_names_every_section_and_the_header_the_what_if_ones(built):
    _, doc = built
    nav = doc.split("<nav>")[1].split("</nav>")[0]
    assert 'href="#s01"' in nav and 'href="#ex1"' in nav and 'href="#top"' in nav
    assert '<a href="#s04" class="whatif">§1 (what-if)</a>' in nav
    assert "position: sticky" in doc.split("</style>")[0]
    assert doc.count("back to the top</a></h2>") == 2                    # every section links back too
    fact = re.search(r"<b>what-if sections</b></td><td>(.*?)</td>", doc).group(1)
    assert fact == f'<a href="#s04">§1 (04)</a>: context = 6 (figures/whatif/04_{run_tag({"context": 6})}/)'
    sec04 = doc.split('id="s04"')[1]
    banner = re.search(r'<p class="whatif">(.*?)</p>', sec04).group(1)
    assert "context = 6 (shipped: 32)" in banner and f"figures/whatif/04_{run_tag({'context': 6})}/" in banner


def test_a_closing_section_gets_a_link(tmp_path):
    make_page(tmp_path, "01", Settings())
    doc = report.build_report(tmp_path / "pages", tmp_path / "report.html",
                              '<h2 id="going-further">Going further: the real system</h2>').read_text()
    nav = doc.split("<nav>")[1].split("</nav>")[0]
    assert '<a href="#going-further">Going further: the real system</a>' in nav


def test_a_rebuild_computes_nothing(tmp_path):
    """Pages saved before the report's run began are an earlier run's: a rebuild (run_all.py --report, which
    runs nothing) says it computed nothing and which pages an earlier run saved."""
    import time
    page = Page("04_smollm2", "blend", "§5", Settings(), Settings(), figures=tmp_path)
    page.finish(cache_events=[{"name": "blend-smollm2", "loaded": False, "seconds": 9.0}])
    doc = report.build_report(tmp_path / "pages", tmp_path / "report.html", since=time.time() + 1).read_text()
    fact = lambda name: re.search(rf"<b>{re.escape(name)}</b></td><td>(.*?)</td>", doc).group(1)  # noqa: E731
    assert fact("computed in this run") == "nothing" and fact("loaded from code/checkpoints/") == "nothing"
    assert fact("saved by an earlier run").startswith("04_smollm2 (this run ran nothing)")
    doc = report.build_report(tmp_path / "pages", tmp_path / "report.html", since=0.0).read_text()
    assert fact("computed in this run") == "blend-smollm2 (04_smollm2)"


def test_run_all_report_says_nothing_was_computed(tmp_path, monkeypatch, capsys):
    from lecture27 import run_all
    page = Page("01", "ledger", "§1", Settings(), Settings(), figures=tmp_path)
    page.finish(cache_events=[{"name": "records", "loaded": False, "seconds": 50.0}])
    monkeypatch.setenv("L27_FIGURES", str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["run_all.py", "--report"])
    run_all.main()
    doc = (tmp_path / "report.html").read_text()
    assert "<b>computed in this run</b></td><td>nothing</td>" in doc
    assert 'href="#going-further"' in doc.split("</nav>")[0]


def test_going_further_gives_each_recompute_ratio_read_from_the_run():
    from lecture27.store.going_further import going_further_table
    row = lambda t: next(r.cells for r in t.rows if r.cells[0] == "blending")  # noqa: E731
    t = going_further_table({"04": {"ratio": 0.2}, "04_smollm2": {"real_ratio": 0.15}})
    assert row(t)[2] == "20% (record world), 15% (SmolLM2)"
    assert row(going_further_table({"04": {"ratio": 0.1}}))[2] == "10% (record world)"
    narrow = going_further_table({"04": {"ratio": 0.2}, "04_smollm2": {"real_ratio": 0.15}}, wide=False)
    i = next(i for i, r in enumerate(narrow.rows) if r.cells[0] == "blending")
    assert narrow.rows[i].cells[1] == "20% (record world)" and narrow.rows[i + 1].cells[:2] == ["", "15% (SmolLM2)"]
    assert max(len(line) for line in render_text(narrow).splitlines()) <= 120


# after load, scrolled to the end: is the navigation still on screen?
SCROLL_PROBE = """<script>
window.addEventListener('load', () => {
  window.scrollTo(0, document.body.scrollHeight);
  const r = document.querySelector('nav').getBoundingClientRect();
  document.body.setAttribute('data-probe', JSON.stringify({top: r.top, bottom: r.bottom, y: window.scrollY,
                                                           h: window.innerHeight}));
});
</script>"""


@pytest.mark.browser
def test_the_navigation_stays_on_screen_in_a_real_browser(tmp_path):
    if not CHROMIUM:
        pytest.skip("no Chromium on this machine (apt-get install chromium): the report's browser check is skipped")
    for script in ["01", "02", "03", "04", "05"]:
        make_page(tmp_path, script, Settings())
    path = report.build_report(tmp_path / "pages", tmp_path / "report.html")
    probed = tmp_path / "scrolled.html"
    probed.write_text(path.read_text().replace("<head>", "<head>" + SCROLL_PROBE, 1))
    dom = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--window-size=1280,800",
                          "--virtual-time-budget=5000", "--dump-dom", probed.as_uri()],
                         capture_output=True, text=True, timeout=120).stdout
    probe = json.loads(re.search(r"data-probe=\"([^\"]*)\"", dom).group(1).replace("&quot;", '"'))
    assert probe["y"] > 1000 and probe["top"] == 0 and 0 < probe["bottom"] < probe["h"], probe


def test_a_long_cell_wraps_in_the_report_too():
    """A schedule as long as a search can make it: the report's table lets its cells wrap (class prose: no
    nowrap) and keeps the text whole; a table of short cells stays unwrapped."""
    from common.present import Field, table_block, table_of

    choices = ", ".join(f"L{i % 3} x{i}" for i in range(2, 60))
    t = table_of("Part 2b", "§4.2", [Field("trace"), Field("oracle's choices", get=0, left=True)], {"t": (choices,)})
    html = report.table_html(table_block(t))
    assert '<table class="data prose">' in html and f"<td>{choices}</td>" in html
    assert re.search(r"table\.prose th, table\.prose td \{ white-space: normal", report.CSS)
    short = table_of("", "§4.2", [Field("trace"), Field("choices", get=0)], {"t": ("L1 x2, L2",)})
    assert '<table class="data">' in report.table_html(table_block(short))


def test_a_reference_column_is_marked_in_the_report(tmp_path):
    """A column of a real GPU's measurements (Col(reference=True)) is marked as the handout's column is."""
    page = Page("01", "the ledger", "§1", Settings(), Settings(), figures=tmp_path)
    page.table(Table(title="one GPU", section="§1.4", cols=[Col("quantity"), Col("time model"),
                                                             Col("H200 measured (2026-12-04)", reference=True)],
                     rows=[Row(["prefill", "360 ms", "348 ms"])], source="ledger.kv_bytes"))
    page.finish()
    doc = report.build_report(tmp_path / "pages", tmp_path / "report.html").read_text()
    assert '<th>H200 measured (2026-12-04)</th>' in doc
    assert '<td>prefill</td><td>360 ms</td><td class="reference">348 ms</td>' in doc
