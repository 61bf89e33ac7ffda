"""present.py's rows that build themselves from results (pick, table_of), plural, and a chart described
by data (Chart, Series, chart_figure): the cells, the --json keys and the figure a description gives."""
from dataclasses import dataclass

import matplotlib.image

from common.present import Chart, Page, Series, chart_figure, pick, plural, render_text, table_json, table_of_items


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


def test_table_of_builds_one_row_per_result_with_its_keys():
    t = table_of_items("Chunk sizes", "§4.2", [("chunk", "chunk", "{:,}"), ("TTFT s", "adaptive.ttft_s", "{:.2f}",
                                                                      "sizes.{row}.ttft_s"),
                                         ("quality", "adaptive.quality", "{:.3f}", "quality")],
                 RUNS, "streaming.part3", ["a note"], {"extra": 1}, row_key=lambda r: str(r.chunk),
                 handout=lambda r: "0.5" if r.chunk == 512 else None)
    assert [r.cells for r in t.rows] == [[512, 0.54, 1.0], [1536, 3.97, 0.999]]
    assert table_json(t) == {"sizes": {"512": {"ttft_s": 0.54}, "1536": {"ttft_s": 3.97}},
                             "quality": [1.0, 0.999], "extra": 1}
    text = render_text(t)
    assert "1,536" in text and "3.97" in text and "handout" in text and "a note" in text


def test_plural():
    assert plural(1, "stream") == "1 stream" and plural(51200, "stream") == "51,200 streams"
    assert plural(0, "context") == "0 contexts"


def test_chart_figure_draws_every_panel(tmp_path):
    page = Page("99", "charts", "§0", figures=tmp_path)
    charts = [Chart([Series([0, 1], [2.0, 3.0], "K", "bar"), Series([0, 1], [1.0, 0.5], "V", "bar")],
                    ylabel="ratio", band=(2.4, 2.9, "handout"), hlines=[(1, {"color": "k"})]),
              Chart([Series([1, 2, 4], [0.1, 0.5, 1.0], "CDF", "step"), Series(2, 0.5, "point", "scatter")],
                    xscale="log", vlines=[(3, {"ls": "--"})], legend=None, grid="both", minor_ticks=False)]
    chart_figure(page, "99_charts.png", charts, "two panels", ncols=2, figsize=(6, 3))
    path = tmp_path / "99_charts.png"
    assert matplotlib.image.imread(path).shape[:2] == (360, 720)   # 6 x 3 inches at 120 dpi
    assert page.blocks[-1] == {"kind": "figure", "path": str(path)}


def test_chart_figure_draws_nothing_with_plotting_off(tmp_path):
    page = Page("99", "charts", "§0", figures=tmp_path, plot=False)
    chart_figure(page, "99_none.png", [Chart([Series([0], [1])])])
    assert not (tmp_path / "99_none.png").exists() and not page.blocks
