"""present.py's tables built from results (Field, table_of, text_table) and figures described by data
(Line, Panel, line_figure, cdf, segment_bars): the rows read their cells from the results, the JSON keys
fill from them, and a figure is drawn, saved and recorded on the page (or skipped with plotting off)."""
from dataclasses import dataclass

from common.present import (Field, Line, Page, Panel, cdf, line_figure, render_text, segment_bars, table_json,
                            table_of, text_table)


@dataclass(frozen=True)
class Layout:
    layers: int


@dataclass(frozen=True)
class Served:
    hit_rate: float
    layout: Layout


RESULTS = {"gpu_only": Served(0.25, Layout(4)), "cpu_fast": Served(0.75, Layout(8))}


def test_a_field_reads_its_value_from_the_result():
    r = RESULTS["cpu_fast"]
    assert Field("config").of("cpu_fast", r) == "cpu_fast"                  # no get: the row's name
    assert Field("hits", get="hit_rate").of("cpu_fast", r) == 0.75          # an attribute
    assert Field("layers", get="layout.layers").of("cpu_fast", r) == 8      # a nested one
    assert Field("twice", get=lambda x: 2 * x.hit_rate).of("cpu_fast", r) == 1.5
    assert Field("tiers", get={"cpu_fast": "GPU 58, CPU 150@50"}).of("cpu_fast", r) == "GPU 58, CPU 150@50"


def test_table_of_builds_one_row_per_result_and_its_json():
    t = table_of("chat", "§6.3", [Field("config"), Field("hits", "{:.0%}", "configs.{row}.hit_rate", get="hit_rate")],
                 RESULTS, "m.f", ["a note"], {"ratio": 3.0}, handout="5x")
    assert [r.key for r in t.rows] == ["gpu_only", "cpu_fast"] and all(r.handout == "5x" for r in t.rows)
    assert table_json(t) == {"configs": {"gpu_only": {"hit_rate": 0.25}, "cpu_fast": {"hit_rate": 0.75}}, "ratio": 3.0}
    assert "cpu_fast   75%       5x" in render_text(t) and t.notes == ["a note"]
    listed = table_of("", "§1", [Field("layers", get="layout.layers")], list(RESULTS.values()),
                      handout=lambda x: "4 layers" if x.layout.layers == 4 else None)
    assert [r.cells for r in listed.rows] == [[4], [8]] and [r.handout for r in listed.rows] == ["4 layers", None]


def test_text_table_keeps_the_given_text():
    t = text_table("stack", "§7", ["layer", "classic"], [("engine", "processor"), ("API", "narrow waist")])
    assert [r.cells for r in t.rows] == [["engine", "processor"], ["API", "narrow waist"]] and not t.has_handout()


def test_cdf_points():
    assert cdf([3.0, 1.0, 2.0, 2.0]) == ([1.0, 2.0, 2.0, 3.0], [0.25, 0.5, 0.75, 1.0])


def test_figures_described_by_data_are_drawn_and_recorded(tmp_path):
    page = Page("99", "test", "§0", figures=tmp_path)
    lines = [Line([1, 2, 4], [1, 4, 16], "o-", "square"), Line(*cdf([1, 2, 3]), "--", "cdf", step=True)]
    line_figure(page, "one.png", Panel(lines, dict(xscale="log", title="one"), [(2.0, "a tier", "C1")]))
    line_figure(page, "two.png", [Panel(lines[:1], dict(xlabel="k")), Panel(lines[1:], legend={"fontsize": 7})], "two")
    segment_bars(page, "bars.png", {"a": [(1.0, "copy 1", "PCIe"), (2.0, "copy 2", "net")], "b": [(0.5, "x", "PCIe")]},
                 {"PCIe": "tab:blue", "net": "tab:red"}, "seconds", "bars")
    assert [b["path"] for b in page.blocks if b["kind"] == "figure"] == [str(tmp_path / n) for n in
                                                                         ("one.png", "two.png", "bars.png")]
    assert all((tmp_path / n).stat().st_size > 1000 for n in ("one.png", "two.png", "bars.png"))
    off = Page("99", "test", "§0", figures=tmp_path / "off", plot=False)
    line_figure(off, "one.png", Panel(lines))
    segment_bars(off, "bars.png", {"a": [(1.0, "x", "PCIe")]}, {"PCIe": "tab:blue"}, "s", "t")
    assert off.blocks == [] and not (tmp_path / "off").exists()
