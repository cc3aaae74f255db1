"""What a run writes: the records as DataFrames and JSON lines, the Chrome trace, time slices, vLLM's
result format, run.json and the summary, the notes under the summary, and the atomic file writes they all
go through."""
