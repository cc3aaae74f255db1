"""A grid of subplots as one layout dict, laid out as plotly's ``make_subplots`` lays it out (cells from
the top left, one x and one y axis each, x axes optionally shared down each column), and the figure made
from it in one ``go.Figure`` call.

Why not ``make_subplots``: it builds the layout through validated updates, and each later
``update_layout``/``update_xaxes`` walks every axis again: ~20 ms a figure, most of a report's time
(a simulated run of seconds spent ~0.4 s on its report). ``go.Figure(data, layout)`` validates the
same dicts once (~2 ms). ``tests/test_report.py`` holds the layouts equal to ``make_subplots``' own.
"""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go
from plotly.basedatatypes import BaseTraceType


class Grid:
    def __init__(self, rows: int, cols: int = 1, titles: list[str] | None = None, shared_xaxes: bool = False,
                 vertical_spacing: float | None = None, horizontal_spacing: float | None = None) -> None:
        # make_subplots' defaults and arithmetic, operation for operation, so that the floats are its floats
        hs = 0.2 / cols if horizontal_spacing is None else horizontal_spacing
        vs = (0.5 / rows if titles is not None else 0.3 / rows) if vertical_spacing is None else vertical_spacing
        for n, spacing in ((cols, hs), (rows, vs)):
            if not 0 <= spacing <= (1.0 / (n - 1) if n > 1 else 1):
                raise ValueError(f"subplot spacing {spacing} does not fit {n} cells")
        widths = [(1.0 - hs * (cols - 1)) / cols] * cols
        heights = [(1.0 - vs * (rows - 1)) / rows] * rows
        self.rows, self.cols = rows, cols
        self.layout: dict[str, Any] = {}
        self.traces: list[BaseTraceType] = []
        annotations = []
        for r in range(rows):  # top to bottom; plotly stacks the rows from the bottom
            up = rows - 1 - r
            y0 = sum(heights[:up]) + up * vs
            y_start, y_end = max(0.0, _clamp(y0)), min(1.0, _clamp(y0 + heights[-1 - r]))
            for c in range(cols):
                x0 = sum(widths[:c]) + c * hs
                x_domain, y_domain = [max(0.0, x0), min(1.0, x0 + widths[c])], [y_start, y_end]
                s = self._suffix(r + 1, c + 1)
                self.layout[f"xaxis{s}"] = {"anchor": f"y{s}", "domain": x_domain}
                self.layout[f"yaxis{s}"] = {"anchor": f"x{s}", "domain": y_domain}
                i = r * cols + c
                if titles and i < len(titles) and titles[i]:
                    annotations.append({"font": {"size": 16}, "showarrow": False, "text": titles[i],
                                        "x": sum(x_domain) / 2.0, "xanchor": "center", "xref": "paper",
                                        "y": y_domain[1], "yanchor": "bottom", "yref": "paper"})
        if shared_xaxes:  # each column's axes follow its bottom one, which alone keeps its tick labels
            for c in range(1, cols + 1):
                bottom = f"x{self._suffix(rows, c)}"
                for r in range(1, rows):
                    self.layout[f"xaxis{self._suffix(r, c)}"].update(matches=bottom, showticklabels=False)
        if annotations:
            self.layout["annotations"] = annotations

    def _suffix(self, row: int, col: int) -> str:
        n = (row - 1) * self.cols + col
        return "" if n == 1 else str(n)

    def add(self, trace: BaseTraceType, row: int, col: int = 1) -> None:
        """``trace`` (a graph object) drawn in cell (row, col), counted from 1 at the top left."""
        s = self._suffix(row, col)
        trace.xaxis, trace.yaxis = f"x{s}", f"y{s}"
        self.traces.append(trace)

    def xaxis(self, row: int, col: int = 1) -> dict[str, Any]:
        """Cell (row, col)'s x axis (a dict of the layout: set its keys)."""
        return self.layout[f"xaxis{self._suffix(row, col)}"]

    def yaxis(self, row: int, col: int = 1) -> dict[str, Any]:
        return self.layout[f"yaxis{self._suffix(row, col)}"]

    def xaxes(self) -> list[dict[str, Any]]:
        return [self.xaxis(r, c) for r in range(1, self.rows + 1) for c in range(1, self.cols + 1)]

    def hline(self, y: float, row: int, line: dict, text: str) -> None:
        """A horizontal line across cell (row, 1) at ``y``, labelled at its top left: ``add_hline``'s shape
        and annotation. Like ``add_hline``, none in a cell that holds no trace."""
        s = self._suffix(row, 1)
        if not any(t.yaxis == f"y{s}" for t in self.traces):
            return
        ref = {"xref": f"x{s} domain", "yref": f"y{s}"}
        self.layout.setdefault("shapes", []).append({"line": line, "type": "line", "x0": 0, "x1": 1, "y0": y,
                                                     "y1": y, **ref})
        self.layout.setdefault("annotations", []).append({"showarrow": False, "text": text, "x": 0,
                                                          "xanchor": "left", "y": y, "yanchor": "bottom", **ref})

    def figure(self, title: str, height: int, **layout: Any) -> go.Figure:
        return go.Figure(self.traces, {**self.layout, "title": {"text": title}, "height": height, **layout})


def _clamp(y: float) -> float:
    """make_subplots' rounding of a y domain end within 0.01 outside [0, 1]."""
    return 0.0 if -0.01 < y < 0.0 else 1.0 if 1.0 < y < 1.01 else y
