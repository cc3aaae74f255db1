"""reports/subplots.py's grid against plotly's own make_subplots: the same layout, float for float, and the
same figure once traces, axis settings and capacity lines are added the two ways."""

import itertools

import plotly.graph_objects as go
import pytest
from plotly.subplots import make_subplots

from reports.subplots import Grid


def _layout(fig: go.Figure) -> dict:
    return fig.layout.to_plotly_json()


CASES = [(rows, cols, titles, shared, vs)
         for rows, cols in [(1, 1), (1, 2), (1, 3), (2, 2), (3, 1), (5, 1), (7, 1), (8, 1), (12, 1)]
         for titles, shared, vs in itertools.product(("none", "all", "some"), (False, True), (None, 0.05, 0.3))
         if vs is None or vs * (rows - 1) < 1]


@pytest.mark.parametrize("rows,cols,titles,shared,vs", CASES)
def test_grid_lays_out_as_make_subplots(rows, cols, titles, shared, vs):
    names = {"none": None, "all": [f"panel {i}" for i in range(rows * cols)],
             "some": ["first", "", "third"]}[titles]
    ref = make_subplots(rows=rows, cols=cols, subplot_titles=names, shared_xaxes=shared, vertical_spacing=vs)
    grid = Grid(rows, cols, names, shared_xaxes=shared, vertical_spacing=vs)
    assert _layout(go.Figure(layout=grid.layout)) == _layout(ref)


def test_a_figure_built_on_the_grid_equals_make_subplots_one():
    ref = make_subplots(rows=3, cols=1, shared_xaxes=True, vertical_spacing=0.07, subplot_titles=["a", "b", "c"])
    grid = Grid(3, titles=["a", "b", "c"], shared_xaxes=True, vertical_spacing=0.07)
    for row in (1, 2):
        ref.add_trace(go.Scatter(x=[1, 2], y=[row, 3], name=f"s{row}"), row=row, col=1)
        grid.add(go.Scatter(x=[1, 2], y=[row, 3], name=f"s{row}"), row)
    for row in (1, 2, 3):  # the third panel holds no trace: add_hline draws nothing there
        ref.add_hline(y=10 * row, line={"dash": "dash", "color": "#888", "width": 1}, row=row, col=1,
                      annotation_text=f"capacity {10 * row}", annotation_position="top left")
        grid.hline(10 * row, row, {"dash": "dash", "color": "#888", "width": 1}, f"capacity {10 * row}")
    ref.update_xaxes(title_text="iteration", row=3, col=1)
    grid.xaxis(3)["title"] = {"text": "iteration"}
    ref.update_yaxes(title_text="slot", autorange="reversed", row=2, col=1)
    grid.yaxis(2).update(title={"text": "slot"}, autorange="reversed")
    ref.update_layout(title="t", height=720, barmode="overlay")
    assert grid.figure("t", 720, barmode="overlay").to_plotly_json() == ref.to_plotly_json()


def test_spacing_that_does_not_fit_is_refused_as_make_subplots_refuses_it():
    with pytest.raises(ValueError):
        make_subplots(rows=5, cols=1, vertical_spacing=0.3)
    with pytest.raises(ValueError):
        Grid(5, vertical_spacing=0.3)
