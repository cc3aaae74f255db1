"""Request traces: synthetic generation, replay of published formats, fitting, and summaries."""

from harness.traces.fit import Fit, fit_trace
from harness.traces.formats import FORMATS, load_trace
from harness.traces.info import trace_info
from harness.traces.synthetic import LENGTH_DISTS, synthetic_trace
from harness.traces.trace import Trace, TraceRequest

__all__ = ["FORMATS", "LENGTH_DISTS", "Fit", "Trace", "TraceRequest", "fit_trace", "load_trace",
           "synthetic_trace", "trace_info"]
