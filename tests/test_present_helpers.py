"""The page's helpers (table.py's, render.py's and charts.py's, imported through present): columns that read a
result (pick, Field), tables built from results (table_of, points, text_table), a quantity row (fact), figures
that hold for the same inputs (refs), sentences from numbers (change, plural), and figures described by data
(Series, Chart, chart_figure, cdf, segment_bars): the cells, the --json keys, and a figure drawn, saved and
recorded on the page (or skipped with plotting off)."""
from dataclasses import dataclass

import matplotlib.image
import pytest

from common.present import (REFERENCE, REPO, Chart, Col, Field, Handout, Page, Ref, Series, Table, cdf, change,
                            chart_figure, fact, pick, plural, points, refs, render_text, segment_bars, table_json,
                            shown, table_of, text_table)


# ----------------------------------------------------------------------------- columns and tables from results
@dataclass(frozen=True)
class Layout:
    layers: int


@dataclass(frozen=True)
class Served:
    hit_rate: float
    layout: Layout


RESULTS = {"gpu_only": Served(0.25, Layout(4)), "cpu_fast": Served(0.75, Layout(8))}


@dataclass
class Result:
    ttft_s: float
    quality: float


@dataclass
class Run:
    chunk: int
    adaptive: Result


RUNS = [Run(512, Result(0.54, 1.0)), Run(1536, Result(3.97, 0.999))]


def test_pick_reads_paths_indexes_and_functions():
    assert pick(RUNS[1], "adaptive.ttft_s") == 3.97
    assert pick({"ttft": {"level0": 2.5}}, "ttft.level0") == 2.5
    assert pick(("a", 7), 1) == 7
    assert pick(RUNS[0], lambda r: r.chunk * 2) == 1024


def test_a_field_reads_its_value_from_the_result():
    r = RESULTS["cpu_fast"]
    assert Field("config").of("cpu_fast", r) == "cpu_fast"                  # no get: the row's name
    assert Field("hits", get="hit_rate").of("cpu_fast", r) == 0.75          # an attribute
    assert Field("layers", get="layout.layers").of("cpu_fast", r) == 8      # a nested one
    assert Field("twice", get=lambda x: 2 * x.hit_rate).of("cpu_fast", r) == 1.5
    assert Field("tiers", get={"cpu_fast": "GPU 58, CPU 150@50"}).of("cpu_fast", r) == "GPU 58, CPU 150@50"
    assert Field("second", get=1).of(None, ("a", 7)) == 7                   # an index of a tuple


def test_table_of_builds_one_row_per_result_and_its_json():
    t = table_of("chat", "§6.3", [Field("config"), Field("hits", "{:.0%}", "configs.{row}.hit_rate", get="hit_rate")],
                 RESULTS, "m.f", ["a note"], {"ratio": 3.0}, handout="5x")
    assert [r.key for r in t.rows] == ["gpu_only", "cpu_fast"] and all(r.handout == "5x" for r in t.rows)
    assert table_json(t) == {"configs": {"gpu_only": {"hit_rate": 0.25}, "cpu_fast": {"hit_rate": 0.75}}, "ratio": 3.0}
    assert "cpu_fast   75%       5x" in render_text(t) and t.notes == ["a note"]
    listed = table_of("", "§1", [Field("layers", get="layout.layers")], list(RESULTS.values()),
                      handout=lambda x: "4 layers" if x.layout.layers == 4 else None)
    assert [r.cells for r in listed.rows] == [[4], [8]] and [r.handout for r in listed.rows] == ["4 layers", None]
    by_name = table_of("", "§1", [Field("config")], RESULTS, handout={"gpu_only": "1x", "cpu_fast": "3x"})
    assert [r.handout for r in by_name.rows] == ["1x", "3x"]


def test_table_of_reads_nested_fields_and_names_rows_in_json():
    fields = [Field("chunk", "{:,}", get="chunk"),
              Field("TTFT s", "{:.2f}", "sizes.{row}.ttft_s", get="adaptive.ttft_s"),
              Field("quality", "{:.3f}", "quality", get="adaptive.quality")]
    t = table_of("Chunk sizes", "§4.2", fields, {str(r.chunk): r for r in RUNS}, "streaming.part3", ["a note"],
                 {"extra": 1}, handout=lambda r: "0.5" if r.chunk == 512 else None)
    assert [r.cells for r in t.rows] == [[512, 0.54, 1.0], [1536, 3.97, 0.999]]
    assert table_json(t) == {"sizes": {"512": {"ttft_s": 0.54}, "1536": {"ttft_s": 3.97}},
                             "quality": [1.0, 0.999], "extra": 1}
    text = render_text(t)
    assert "1,536" in text and "3.97" in text and "handout" in text and "a note" in text
    unnamed = table_of("", "§4.1", [Field("x", key="x.{row}", get=0)], {None: (1,), "a": (2,)})
    assert table_json(unnamed) == {"x": {"a": 2}}                           # a row named None states no key


@dataclass
class Sweep:
    ks: list
    ttft_s: list


def test_points_of_a_sweep_are_rows():
    fields = [Field("k", get="ks"), Field("TTFT s", "{:.2f}", "ttft_s", get="ttft_s")]
    assert points(Sweep([1, 2], [0.5, 0.75]), fields) == [{"ks": 1, "ttft_s": 0.5}, {"ks": 2, "ttft_s": 0.75}]
    t = table_of("", "§5.1", fields, points(Sweep([1, 2], [0.5, 0.75]), fields))
    assert [r.cells for r in t.rows] == [[1, 0.5], [2, 0.75]] and table_json(t) == {"ttft_s": [0.5, 0.75]}


def schedule(rng, n: int) -> str:
    """An oracle's choices as 03 writes them ("L1 x2, L2, L1 x6"), n runs long."""
    return ", ".join(f"L{rng.randrange(4)}" + (f" x{k}" if (k := rng.randrange(1, 30)) > 1 else "") for _ in range(n))


@pytest.mark.parametrize("n", [1, 10, 13, 40, 200])
def test_a_long_cell_wraps_in_its_column_and_json_keeps_it_whole(n):
    """A cell as long as a search can make it (a schedule of n runs, a name of 150 letters): no line is wider
    than 120; the row's other cells stay on its first line, the cell's lines give its text back, and --json
    holds the whole value."""
    import random
    import re

    from common.present import WIDTH, cell_lines

    rng = random.Random(n)
    runs = {f"trace {i}": (schedule(rng, n), 1.5 + i, "x" * (150 if i == 2 else 4)) for i in range(3)}
    fields = [Field("trace"), Field("oracle's choices", key="runs.{row}.choices", get=0, left=True),
              Field("TTFT s", "{:.2f}", get=1), Field("name", get=2, left=True)]
    t = table_of("Part 2b", "§4.2", fields, runs, handout=lambda r: "1.9 s")
    lines = render_text(t).splitlines()
    assert max(map(len, lines)) <= WIDTH
    assert table_json(t) == {"runs": {k: {"choices": v[0]} for k, v in runs.items()}}
    sep = lines.index(next(ln for ln in lines if ln and set(ln) <= {"-", " "}))
    spans = [m.span() for m in re.finditer("-+", lines[sep])]
    rows = []
    for ln in lines[sep + 1:]:
        cells = [ln.ljust(WIDTH)[a:b].strip() for a, b in spans]
        if cells[0]:
            rows.append([cells])
        else:
            rows[-1].append(cells)
    assert [r[0][0] for r in rows] == list(runs)
    for r, (choices, ttft, _) in zip(rows, runs.values()):
        assert " ".join(c[1] for c in r if c[1]) == choices
        assert r[0][2:] == [f"{ttft:.2f}", r[0][3], "1.9 s"] and all(not c[2] and not c[4] for c in r[1:])
        assert (sum(1 for c in r if c[1]) > 1) == (len(choices) > spans[1][1] - spans[1][0])  # wraps when too wide
    for width in (10, 25, 60):
        text = schedule(rng, n)
        assert all(len(x) <= width for x in cell_lines(text, width)) and " ".join(cell_lines(text, width)) == text
        assert all(not x.startswith("x") for x in cell_lines(text, width))   # "L1 x2" stays on one line
    assert cell_lines("short", 10) == ["short"]


def test_text_table_keeps_the_given_text():
    t = text_table("stack", "§7", ["layer", "classic"], [("engine", "processor"), ("API", "narrow waist")])
    assert [r.cells for r in t.rows] == [["engine", "processor"], ["API", "narrow waist"]] and not t.has_handout()


# ----------------------------------------------------------------------------- rows, handout figures, sentences
@dataclass(frozen=True)
class Settings:
    chunk_len: int = 5
    ratio: float = 0.2


def test_fact_is_a_row_with_its_own_key_format_and_handout():
    ref = Ref("99.4%", {"chunk_len": 5})
    t = Table(title="", section="§5.3", cols=[Col("quantity"), Col("ours", "{:.1%}")],
              rows=[fact("CacheBlend", 0.995, "blend_acc", handout=ref), fact("chunk length", 5, fmt="{}"),
               fact("nothing measured", None)])
    assert [line.split() for line in render_text(t).splitlines()[2:]] == [
        ["CacheBlend", "99.5%", "99.4%"], ["chunk", "length", "5", "-"], ["nothing", "measured", "-", "-"]]
    assert table_json(t) == {"blend_acc": 0.995}
    assert t.rows[0].handout is ref


def test_refs_share_their_inputs():
    h = Handout({**refs({"chunk_len": 5}, {"split": "8.8%", "top": "98.0%"}), "train": Ref("12,000 steps")})
    assert h("split", Settings()).figure == "8.8%" and h("top", Settings()).inputs == {"chunk_len": 5}
    assert h("split", Settings(chunk_len=6)) is None and h.figure("train", Settings(chunk_len=6)) == "12,000 steps"


def test_change_and_plural():
    assert change(0.2, 0.5, "{:.0%}") == "rises (20% -> 50%)" and change(0.001, 0.002, "{:.0%}") == "stays at 0%"
    assert plural(1, "stream") == "1 stream" and plural(51200, "stream") == "51,200 streams"
    assert plural(0, "context") == "0 contexts"


# ----------------------------------------------------------------------------- figures described by data
def test_cdf_points():
    assert cdf([3.0, 1.0, 2.0, 2.0]) == ([1.0, 2.0, 2.0, 3.0], [0.25, 0.5, 0.75, 1.0])


def test_chart_figure_draws_every_panel(tmp_path):
    page = Page("99", "charts", "§0", figures=tmp_path)
    charts = [Chart(series=[Series([0, 1], [2.0, 3.0], "K", "bar"), Series([0, 1], [1.0, 0.5], "V", "bar")],
                    ylabel="ratio", band=(2.4, 2.9, "handout"), hlines=[(1, {"color": "k"})]),
              Chart(series=[Series([1, 2, 4], [0.1, 0.5, 1.0], "CDF", "step"), Series(2, 0.5, "point", "scatter"),
                     Series([1, 2, 4], [0.2, None, 0.9], "a gap", style={"marker": "o"})],
                    xscale="log", vlines=[(3, {"ls": "--"})], hlines=[(0.5, {**REFERENCE, "label": "chance"})],
                    legend=None, grid="both", minor_ticks=False),
              Chart(series=[Series(["a", "b"], [1.0, 10.0], kind="barh", style={"color": ["red", "blue"]},
                                   fmt=" {:.1f} ms")],
                    xlabel="ms", title="bars", xscale="log", legend=None)]
    chart_figure(page, "99_charts.png", charts, "three panels", figsize=(9, 3))
    path = tmp_path / "99_charts.png"
    assert matplotlib.image.imread(path).shape[:2] == (360, 1080)   # 9 x 3 inches at 120 dpi, one row
    assert page.blocks[-1] == {"kind": "figure", "path": str(path)}
    chart_figure(page, "99_grid.png", charts[:2], ncols=1, figsize=(4, 6))
    assert matplotlib.image.imread(tmp_path / "99_grid.png").shape[:2] == (720, 480)   # two rows of one


def test_segment_bars_are_drawn_and_recorded(tmp_path):
    page = Page("99", "test", "§0", figures=tmp_path)
    segment_bars(page, "bars.png", {"a": [(1.0, "copy 1", "PCIe"), (2.0, "copy 2", "net")], "b": [(0.5, "x", "PCIe")]},
                 {"PCIe": "tab:blue", "net": "tab:red"}, "seconds", "bars")
    assert page.blocks == [{"kind": "figure", "path": str(tmp_path / "bars.png")}]
    assert (tmp_path / "bars.png").stat().st_size > 1000


def test_figures_draw_nothing_with_plotting_off(tmp_path):
    off = Page("99", "test", "§0", figures=tmp_path / "off", plot=False)
    chart_figure(off, "99_none.png", Chart(series=[Series([0], [1])]))
    segment_bars(off, "bars.png", {"a": [(1.0, "x", "PCIe")]}, {"PCIe": "tab:blue"}, "s", "t")
    assert off.blocks == [] and not (tmp_path / "off").exists()


def test_a_path_in_the_clone_is_printed_from_its_root(tmp_path):
    # the printed line must read the same wherever the clone lies (CI clones it under another folder)
    assert shown(REPO / "code" / "checkpoints" / "x.pt") == "code/checkpoints/x.pt"
    assert shown(tmp_path / "a.json") == str(tmp_path / "a.json")


# ----------------------------------------------------------------------------- the handout's inputs, --json
def test_a_handout_figure_holds_for_its_inputs_compared_as_numbers():
    from common.present import holds
    assert holds({"r": 0.3}, {"r": 0.1 + 0.2})                  # a float input after arithmetic still holds
    assert not holds({"r": 0.3}, {"r": 0.31})
    with pytest.raises(KeyError):                               # a mistyped input fails loudly, rather
        holds({"nope": 1}, {"r": 1})                             # than show the figure
    h = Handout({"x": Ref("1", {"bytes": 1})}, bytes=2)          # a figure's own inputs win over the common ones
    assert h("x", {"bytes": 1}) is not None and h("x", {"bytes": 2}) is None


def test_one_reason_per_difference_and_json_columns_scaled_and_without_blanks():
    from common.present import Row, why_notes
    w = Ref("9", {}, why="w")
    t = Table(title="t", section="§1", cols=[Col("q"), Col("GB", "{}", "kv_gb", 1e-9), Col("x", "{}", "x"),
                          Col("y", "{}", "lv[].gb", 1e-9)],
              rows=[Row(["a", 2e9, 1, 3e9], w), Row(["b", 4e9, None, 4e9], w), Row(["c", 1e9, 3, 5e9])])
    assert why_notes(t) == ["w"] and render_text(t).count("* handout: w") == 1
    assert table_json(t) == {"kv_gb": [2.0, 4.0, 1.0], "x": [1, 3], "lv": [{"gb": 3.0}, {"gb": 4.0}, {"gb": 5.0}]}


def test_a_page_records_the_cache_events_of_its_run(tmp_path):
    import json

    from common import checkpoints
    before = len(checkpoints.EVENTS)
    checkpoints.cached("present-test", {"n": 1}, lambda: {"v": 1}, store=False)
    page = Page("99", "t", "§1", figures=tmp_path)
    page.finish()
    saved = json.loads((tmp_path / "pages" / "99.json").read_text())["cache"]
    assert len(checkpoints.EVENTS) == before + 1 and saved[-1]["name"] == "present-test"
