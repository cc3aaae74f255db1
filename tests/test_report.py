"""The HTML report: built from a real small run, opened in headless Chromium, escaped, bounded in size."""

import itertools
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from reports.html import write_report
from reports.load import load_runs
from reports.tables import ratio_table, summary_table

pytestmark = pytest.mark.xdist_group("report")  # one worker: its module fixture is built once

EVIL = "<script>alert('x')</script>"
EVIL_FILE = "<img src=x onerror=alert('x')><script>alert('x')<"  # a file name cannot hold "/"
SHOTS = Path(__file__).parent / "artifacts"


def slotbench(*args):
    p = subprocess.run([sys.executable, "-m", "harness.cli", *args], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    return p


@pytest.fixture(scope="module")
def evil_run(tmp_path_factory):
    """A small real run whose trace file name carries a script tag."""
    root = tmp_path_factory.mktemp("rep")
    trace = root / f"{EVIL_FILE}.jsonl"
    trace.write_text("".join(json.dumps({"arrival_s": i * 0.002, "input_tokens": 10 + i % 7, "output_tokens": 6,
                                         "request_id": f"{EVIL}{i}"}) + "\n" for i in range(30)))
    out = root / "run"
    slotbench("run", "--model", "tiny", "--trace", str(trace), "--max-seq-len", "64", "--warmup", "1",
              "--no-progress", "--out", str(out))
    return out


def test_user_strings_are_escaped(evil_run):
    html = (evil_run / "report.html").read_text()
    assert EVIL_FILE not in html and "<img src=x" not in html
    assert "&lt;img src=x onerror=alert(&#x27;x&#x27;)&gt;" in html  # the metadata block shows it, inert
    # a strategy label rendered into a table is escaped too
    summary = pd.read_csv(evil_run / "summary.csv").assign(strategy=EVIL)
    from reports.tables import to_html_table

    assert EVIL not in to_html_table(summary) and "&lt;script&gt;" in to_html_table(summary)


def test_ratios_against_baseline(evil_run):
    runs = load_runs([evil_run])
    s = summary_table([(r.name, r.summary) for r in runs])
    ratios = ratio_table(s, "static")
    assert (ratios.loc[ratios["strategy"] == "static", "output_throughput"] == 1.0).all()
    inflight = s.set_index("strategy").loc["inflight"]
    static = s.set_index("strategy").loc["static"]
    r = ratios.set_index("strategy").loc["inflight", "output_throughput"]
    assert r == pytest.approx(inflight["output_throughput"] / static["output_throughput"])


def test_report_renders_in_chromium(evil_run, tmp_path, chromium):
    playwright = pytest.importorskip("playwright.sync_api")
    compare = tmp_path / "compare.html"
    slotbench("report", str(evil_run), str(evil_run), "--out", str(compare))
    errors: list[str] = []
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=[
            "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("dialog", lambda d: errors.append(f"dialog opened: {d.message}"))
            for report, num_runs in ((evil_run / "report.html", 1), (compare, 2)):
                page.goto(report.as_uri())
                page.wait_for_function("document.querySelectorAll('.js-plotly-plot').length > 0")
                plots = page.locator(".js-plotly-plot")
                n = plots.count()
                # latency, over time, KV cache, padding, buffer fill; per run an iteration timeline, slot
                # occupancy and buffer sets
                assert n == 5 + 3 * num_runs
                titles = " | ".join(plots.nth(i).locator(".gtitle").first.text_content() for i in range(n))
                assert "Slot occupancy: which request holds each slot" in titles and "buffer set" in titles
                assert "Buffer fill per iteration, against capacity" in titles
                for i in range(n):
                    assert plots.nth(i).locator("svg.main-svg").count() >= 1, f"figure {i} has no SVG"
                assert page.locator("table.data").count() == 3  # summary, host and device, ratios
                assert page.locator("h2", has_text="Host and device").count() == 1
                assert page.locator("text=run #2").count() >= (1 if num_runs == 2 else 0)
            SHOTS.mkdir(exist_ok=True)
            page.goto((evil_run / "report.html").as_uri())
            page.wait_for_timeout(500)
            page.screenshot(path=str(SHOTS / "report.png"), full_page=True)
        finally:
            browser.close()
    assert errors == []
    assert (SHOTS / "report.png").stat().st_size > 10_000


def test_report_size_is_bounded_for_many_requests(tmp_path):
    """10,000 requests with long outputs: per-token series are aggregated, the page stays under 10 MB. (On
    the simulated device: the records are the same kind and size, and the run takes a fraction of the time.)"""
    out = tmp_path / "big"
    slotbench("run", "--device", "sim", "--model-spec", "tiny", "--strategies", "inflight", "--num-prompts", "10000",
              "--input-len", "8", "--output-len", "40", "--ignore-eos", "--max-batch-size", "64", "--max-seq-len",
              "64", "--warmup", "0", "--no-progress", "--out", str(out))
    size = (out / "report.html").stat().st_size
    assert size < 10 * 2**20, size
    write_report([out], tmp_path / "again.html")
    assert (tmp_path / "again.html").stat().st_size < 10 * 2**20


def test_a_runs_report_from_what_it_holds_equals_the_report_from_its_files(tmp_path):
    """A run renders its report from the frames it wrote, not read back: the page must be the one that
    ``slotbench report`` renders from the files (every strategy, a rejected request, slices, beams off and
    on the slot and token records)."""
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"arrival_s": i * 0.003, "input_tokens": 70 if i == 5 else 8 + i % 9,
                                         "output_tokens": 5 + i % 4}) + "\n" for i in range(24)))
    out = tmp_path / "run"
    slotbench("run", "--model", "tiny", "--trace", str(trace), "--max-seq-len", "64", "--warmup", "0",
              "--strategies", "inflight,overlap,static", "--slice-duration", "0.02", "--no-progress",
              "--out", str(out))
    assert (pd.read_parquet(out / "inflight" / "requests.parquet")["status"] == "rejected").sum() == 1
    write_report([out], tmp_path / "again.html", names=["run"])
    assert (out / "report.html").read_text() == (tmp_path / "again.html").read_text()


def test_token_arrays_equal_request_by_request():
    """The flat pass over every request's token times (what a report reads, from a run's files or from the
    frames it holds) against the per-request arrays it replaced: empty, one-token, finished and unfinished
    requests."""
    from reports.token_times import TokenTimes

    def _token_arrays(ids, times, finished):
        held = TokenTimes.of(dict(zip(ids, times, strict=True)), ids)
        return held.flat, held.gaps(np.array([rid in finished for rid in ids], bool)) * 1e3

    rng = np.random.default_rng(0)
    lengths = [0, 1, 5, 0, 3, 1, 7, 2]
    times = [np.cumsum(rng.random(n)).tolist() for n in lengths]
    ids = [f"r{i}" for i in range(len(lengths))]
    finished = {"r1", "r2", "r4", "r6", "r7"}
    flat, itl = _token_arrays(ids, times, finished)
    assert flat.tolist() == [t for ts in times for t in ts]
    expect = [(b - a) * 1e3 for i, ts in zip(ids, times, strict=True) if i in finished
              for a, b in itertools.pairwise(ts)]
    assert itl.tolist() == expect and len(expect) == 4 + 2 + 6 + 1
    assert _token_arrays([], [], set())[1].shape == (0,)


def test_numbers_read_as_a_person_reads_them():
    from reports.tables import format_number, readable

    cases = [(1718.4999, "1,718.5"), (4.16, "4.160"), (45.338, "45.34"), (0.0771, "0.07710"),
             (1.2e-5, "0.00001200"), (773434, "773,434"), (773434.0, "773,434.0"), (999.96, "1,000.0"), (0.0, "0"),
             (-2.5, "-2.500"), (float("nan"), "–"), (float("inf"), "∞"), ("inflight", "inflight"), (True, "True")]
    for value, text in cases:
        assert format_number(value) == text, value
    df = pd.DataFrame({"x": [1.72e3, 3.3e-4], "n": np.array([12, 1_000_000])})
    assert readable(df).to_dict("list") == {"x": ["1,720.0", "0.0003300"], "n": ["12", "1,000,000"]}
