"""present.py's small helpers: a quantity row (fact), figures that hold for the same inputs (refs),
rows that read a result's fields (Col.of, rows_of, rows_over), and figures described by data
(marked_line_figure, bar_figure)."""
from dataclasses import dataclass

import matplotlib.image

from common.present import (Bars, Col, Handout, MarkedLine, Mark, Page, Ref, Table, bar_figure, fact, marked_line_figure, refs,
                            render_text, rows_of, rows_over, table_json)


@dataclass(frozen=True)
class Settings:
    chunk_len: int = 5
    ratio: float = 0.2


def test_fact_is_a_row_with_its_own_key_format_and_handout():
    ref = Ref("99.4%", {"chunk_len": 5})
    t = Table("", "§5.3", [Col("quantity"), Col("ours", "{:.1%}")],
              [fact("CacheBlend", 0.995, "blend_acc", handout=ref), fact("chunk length", 5, fmt="{}"),
               fact("nothing measured", None)])
    assert [line.split() for line in render_text(t).splitlines()[2:]] == [
        ["CacheBlend", "99.5%", "99.4%"], ["chunk", "length", "5", "-"], ["nothing", "measured", "-", "-"]]
    assert table_json(t) == {"blend_acc": 0.995}
    assert t.rows[0].handout is ref


def test_refs_share_their_inputs():
    h = Handout({**refs({"chunk_len": 5}, {"split": "8.8%", "top": "98.0%"}), "train": Ref("12,000 steps")})
    assert h("split", Settings()).figure == "8.8%" and h("top", Settings()).inputs == {"chunk_len": 5}
    assert h("split", Settings(chunk_len=6)) is None and h.figure("train", Settings(chunk_len=6)) == "12,000 steps"


@dataclass
class Point:
    k: int
    ttft_s: float


@dataclass
class Sweep:
    ks: list
    ttft_s: list


def test_rows_build_themselves_from_fields():
    columns = [Col("k", of="k"), Col("TTFT s", "{:.2f}", "ttft_s", of="ttft_s"),
               Col("ms", "{:.0f}", of=lambda p: 1e3 * p.ttft_s)]
    rows = rows_of([Point(1, 0.5), Point(2, 0.75)], columns)
    assert [r.cells for r in rows] == [[1, 0.5, 500.0], [2, 0.75, 750.0]]
    over = rows_over(Sweep([1, 2], [0.5, 0.75]), [Col("k", of="ks"), Col("TTFT s", "{:.2f}", "ttft_s", of="ttft_s")])
    assert [r.cells for r in over] == [[1, 0.5], [2, 0.75]]
    assert table_json(Table("", "§5.1", columns, rows)) == {"ttft_s": [0.5, 0.75]}


def test_line_and_bar_figures_are_drawn_from_data(tmp_path, capsys):
    page = Page("99", "test", "§0", figures=tmp_path)
    marked_line_figure(page, "lines.png", "two lines", [MarkedLine([0, 1, 2], [1, None, 3], "a", dict(marker="o")),
                                                MarkedLine([0, 2], [2, 2], None, dict(color="gray"))],
                "x", "y", [Mark(1.5, "chance"), Mark(1, vertical=True)], ylim=(0, 4))
    bar_figure(page, "bars.png", "two panels", [Bars(["a", "b"], [1.0, 10.0], ["red", "blue"], " {:.1f} ms", "one"),
                                               Bars(["c"], [3.0], title="two")], "ms", xscale="log")
    out = capsys.readouterr().out
    for name in ("lines.png", "bars.png"):
        assert matplotlib.image.imread(tmp_path / name).shape[0] > 100 and f"figure: {tmp_path / name}" in out
    assert [b["path"] for b in page.blocks] == [str(tmp_path / "lines.png"), str(tmp_path / "bars.png")]
    off = Page("99", "test", "§0", figures=tmp_path / "off", plot=False)   # --no-plot: nothing drawn
    marked_line_figure(off, "lines.png", "", [MarkedLine([0], [0])], "x", "y")
    bar_figure(off, "bars.png", "", [Bars(["a"], [1.0])], "ms")
    assert off.blocks == [] and not (tmp_path / "off").exists()
