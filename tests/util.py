"""Shared test helpers: a small model, a list-backed request source, a reference decoder, the CLI (in this
process, or a subprocess), and the commented CSV samples in tests/data."""

from __future__ import annotations

import csv
import os
import re
import select
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

import numpy as np
import torch

from strategies.config import ExecutorConfig
from strategies.registry import get_strategy
from strategies.runtime.decoder.sampler import sample
from strategies.runtime.models.config import PRESETS, ModelConfig
from strategies.runtime.models.llama import build_model, script_model
from strategies.runtime.request import Request, Status
from strategies.runtime.sampling_params import SamplingParams

DATA = Path(__file__).parent / "data"


def cli(*args: str, timeout: float = 300, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``slotbench ARGS``, output captured: in this process, through the CLI's own ``main`` (no interpreter
    start-up, the test worker's idle device processes reused: ~3 s less a run here); with ``env`` (added to this
    process's) in a fresh interpreter. What only a process shows — signals, the console script's exit, what is
    left running — is tested with a subprocess of its own (tests/test_cli.py and others)."""
    if env is not None:
        return subprocess.run([sys.executable, "-m", "harness.cli", *args], capture_output=True, text=True,
                              timeout=timeout, env={**os.environ, **env})
    return cli_in_process(*args)


def cli_in_process(*args: str) -> subprocess.CompletedProcess:
    """``harness.cli.main(ARGS)`` with stdout and stderr captured and the SIGINT handler it installs put back."""
    import contextlib
    import io
    import signal

    from harness.cli import main

    out, err, handler = io.StringIO(), io.StringIO(), signal.getsignal(signal.SIGINT)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as exc:  # argparse's refusals
                code = exc.code if isinstance(exc.code, int) else 2
    finally:
        signal.signal(signal.SIGINT, handler)
    return subprocess.CompletedProcess(["slotbench", *args], code, out.getvalue(), err.getvalue())


def data_rows(name: str) -> list[dict[str, str]]:
    """The rows of tests/data/NAME, a CSV whose leading ``#`` lines say where its figures come from."""
    lines = (DATA / name).read_text().splitlines()
    return list(csv.DictReader(line for line in lines if not line.startswith("#")))


# float64 so that different batch shapes cannot flip a near-tie between two logits.
TINY64 = PRESETS["tiny"].with_dtype("float64")


class Queues:
    """A policy's queues (``strategies/parts.py``: Queues) for a policy called on its own: a waiting queue, a
    count of free slots, and what admit and preempt do (nothing, by default)."""

    def __init__(self, waiting=(), free_slots: int = 0, admit=None, preempt=None) -> None:
        self.waiting = deque(waiting)
        self.free_slots = free_slots
        self.admit = admit or (lambda *a: None)
        self.preempt = preempt or (lambda r: None)


class ListSource:
    """All requests known up front; arrivals by their ``arrival_s``."""

    def __init__(self, requests: list[Request]) -> None:
        self.requests = sorted(requests, key=lambda r: r.arrival_s)
        self.i = 0
        self.ended: list[Request] = []

    def poll(self, now_s: float) -> list[Request]:
        out = []
        while self.i < len(self.requests) and self.requests[self.i].arrival_s <= now_s:
            out.append(self.requests[self.i])
            self.i += 1
        return out

    def next_arrival_s(self) -> float | None:
        return self.requests[self.i].arrival_s if self.i < len(self.requests) else None

    @property
    def exhausted(self) -> bool:
        return self.i >= len(self.requests)

    def on_finished(self, request: Request) -> None:
        self.ended.append(request)


def make_requests(specs: list[tuple[list[int], int, SamplingParams]], arrival_s: float = 0.0) -> list[Request]:
    return [Request(f"r{i}", np.asarray(p, dtype=np.int64), n, s, arrival_s=arrival_s)
            for i, (p, n, s) in enumerate(specs)]


def run_strategy(name: str, model_cfg: ModelConfig, model: torch.nn.Module, config: ExecutorConfig,
                 requests: list[Request], keep_open: bool = False):
    """Serve ``requests``; ``keep_open`` leaves the engine alive for inspection (the caller closes)."""
    strategy = get_strategy(name)(model_cfg, model, config)
    try:
        strategy.run(ListSource(requests))
    finally:
        if not keep_open:
            strategy.close()
    return strategy


def reference_decode(model: torch.nn.Module, cfg: ModelConfig, r: Request) -> list[int]:
    """One request alone, every token by full recomputation of the whole sequence (no KV reuse)."""
    s = r.sampling
    tokens = list(r.prompt_token_ids)
    stops = set(s.stop_token_ids) | (set() if s.ignore_eos else {cfg.eos_token_id})
    out: list[int] = []
    no_gen = torch.empty(0, dtype=torch.long)
    for step in range(r.max_new_tokens):
        n = len(tokens)
        pool = torch.zeros((cfg.num_hidden_layers, cfg.num_key_value_heads, n, cfg.head_dim), dtype=cfg.torch_dtype)
        no_mask = torch.zeros((1, 0, 1, 0), dtype=cfg.torch_dtype)
        logits = model(torch.tensor(tokens), torch.arange(n), torch.arange(n), pool, torch.zeros_like(pool), [0], [n],
                       [0], [no_gen], n, no_gen, no_gen, no_mask, torch.tensor([n - 1]))
        logits = logits.float()  # as Hugging Face samples: float32 logits whatever the model dtype
        tok = int(sample(logits, torch.tensor([s.temperature]), torch.tensor([s.top_k]), torch.tensor([s.top_p]),
                         torch.tensor([s.min_p]), torch.tensor([s.seed]), torch.tensor([step]), s.uses_filters)[0])
        out.append(tok)
        tokens.append(tok)
        if tok in stops:
            break
    return out


_MODELS: dict[str, tuple[torch.nn.Module, torch.nn.Module]] = {}


def tiny_models() -> tuple[torch.nn.Module, torch.nn.Module]:
    """(eager, scripted) tiny float64 model, built once per test session."""
    if "tiny" not in _MODELS:
        eager = build_model(TINY64)
        _MODELS["tiny"] = (eager, script_model(eager))
    return _MODELS["tiny"]


def assert_accounted(requests: list[Request]) -> None:
    for r in requests:
        assert r.status.terminal, f"{r.request_id} ended {r.status}"
        assert r.finish_reason, f"{r.request_id} has no reason"
        if r.status is Status.FINISHED:
            assert 1 <= r.num_output_tokens <= r.max_new_tokens


def wait_for_progress(proc: subprocess.Popen, strategy: str, done: int, timeout_s: float = 120.0) -> str:
    """Read ``proc``'s stderr until the progress bar of ``strategy`` shows at least ``done`` finished
    requests (tqdm redraws with carriage returns, so the pipe is read in chunks, not lines). Returns what
    was read; fails if the process ends or the time runs out first."""
    fd, seen = proc.stderr.fileno(), b""
    bar = re.compile(rb"\s*" + re.escape(strategy.encode()) + rb":.*?\|\s*(\d+)/\d+")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.1)
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            seen += chunk
            counts = [int(m.group(1)) for m in bar.finditer(seen[-4096:])]
            if counts and max(counts) >= done:
                return seen.decode(errors="replace")
    raise AssertionError(f"{strategy} never reached {done} requests; stderr so far: {seen[-500:]!r}")


def child_pids(proc: subprocess.Popen, marker: str, count: int, timeout_s: float = 60.0) -> list[int]:
    """Pids of ``proc``'s children whose command line holds ``marker``, once there are ``count`` of them."""
    pids: list[int] = []
    deadline = time.time() + timeout_s
    while len(pids) < count and time.time() < deadline:
        out = subprocess.run(["ps", "-ww", "-o", "pid=,args=", "--ppid", str(proc.pid)], capture_output=True,
                             text=True).stdout
        pids = [int(line.split()[0]) for line in out.splitlines() if marker in line]
        time.sleep(0.2)
    return pids


def still_alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            out.append(pid)
        except ProcessLookupError:
            pass
    return out



def char_tokenizer(chars: str, unk: str, **special: str):
    """A Hugging Face fast tokenizer of one id per character of ``chars`` (after ``unk`` 0, ``<s>`` 1, ``</s>`` 2)
    whose post-processor adds BOS, as Llama's does; ``special``: its other special tokens (``pad_token=...``)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {unk: 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(dict.fromkeys(chars))}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", **special)
