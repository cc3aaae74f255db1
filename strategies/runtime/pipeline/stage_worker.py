"""A pipeline stage's process: receive a micro-batch, run this stage's layers, pass the hidden states on.

Rank 0 is the host; stage ``s`` is rank ``s + 1``. Per micro-batch a stage receives the host's message
(``messages.py``) into the buffer set of that micro-batch, the previous stage's hidden states (not the
first stage), computes, and sends its hidden states to the next stage, or — the last stage, which holds
the single decoder state — samples and sends the tokens and finish codes back to the host (the first
rank), as TensorRT-LLM's asynchronous decoder-step send does. Every stage reports when it computed.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from strategies.runtime.buffers.family import MAX_STOP_IDS
from strategies.runtime.buffers.memory import DeviceMemory
from strategies.runtime.buffers.step_io import ADMIT_INTS
from strategies.runtime.decoder.state import DecoderState
from strategies.runtime.kv.host_pool import KVHostPool
from strategies.runtime.kv.pool import KVCachePool
from strategies.runtime.models.config import ModelConfig
from strategies.runtime.models.llama import script_model
from strategies.runtime.pipeline import messages as m
from strategies.runtime.pipeline.stage_model import StageModel

HOST = 0
STARTUP_TIMEOUT_S = 60.0  # the least time a stage group gets to form
# How long a stage waits for the host's next step: without limit in practice, as a run may have no requests for
# longer than --stage-timeout (a lull in a trace, an idle server); a host that dies closes its socket, which ends
# the wait at once
HOST_IDLE = timedelta(days=365)
# exit codes: this stage failed; a peer's socket closed (not the cause); a peer went silent past --stage-timeout (not
# the cause either: the silent one is, and it may still be alive)
FAILED, PEER_LOST, PEER_SILENT = 1, 2, 4


def connect(port: int, rank: int, world: int, timeout_s: float) -> tuple[dist.ProcessGroupGloo, dist.TCPStore]:
    """A gloo group of its own (not torch.distributed's default group), so that one process may hold
    several pipelines — a warm-up's and a run's, or a test's — one after another or at once. The host
    (rank 0) owns the store; a stage connects to it. The store must live as long as the group."""
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == HOST, timeout=startup_timeout(timeout_s),
                          wait_for_workers=False)
    return join_group(store, rank, world, timeout_s), store


def join_group(store: dist.TCPStore, rank: int, world: int, timeout_s: float,
               alive: Callable[[], None] | None = None) -> dist.ProcessGroupGloo:
    """Announce ``rank`` and wait, within the start-up bound, until every rank has; then form the group,
    whose own timeout (``--stage-timeout``) bounds its rendezvous and every later send and receive. (A stage
    process imports torch first, which on a loaded machine takes seconds: the group's rendezvous would time
    out on a short ``--stage-timeout`` before the last rank arrived.) ``alive`` (the host's) is called while
    waiting and raises if a stage died during start-up."""
    store.set(f"slotbench/ready/{rank}", "1")
    keys = [f"slotbench/ready/{r}" for r in range(world)]
    deadline = time.monotonic() + startup_timeout(timeout_s).total_seconds()
    while True:
        try:
            store.wait(keys, timedelta(seconds=1))
            break
        except dist.DistStoreError:
            if alive is not None:
                alive()
            if time.monotonic() >= deadline:
                raise RuntimeError(f"pipeline: the stage group did not form within "
                                   f"{startup_timeout(timeout_s).total_seconds():g} s") from None
    return dist.ProcessGroupGloo(store, rank, world, timedelta(seconds=timeout_s))


def startup_timeout(timeout_s: float) -> timedelta:
    """How long the group may take to form: at least STARTUP_TIMEOUT_S, however short ``--stage-timeout``."""
    return timedelta(seconds=max(timeout_s, STARTUP_TIMEOUT_S))


class StageSpec:
    """Everything a stage process needs, picklable: the model config, its weights, its layer range, sizes."""

    def __init__(self, cfg: ModelConfig, state: dict[str, torch.Tensor], stage: int, stages: int,
                 layers: tuple[int, int], sizes: dict[str, int], port: int, timeout_s: float, threads: int) -> None:
        self.cfg, self.state, self.stage, self.stages, self.layers = cfg, state, stage, stages, layers
        self.sizes, self.port, self.timeout_s, self.threads = sizes, port, timeout_s, threads


def main(spec: StageSpec) -> None:
    """The process's entry point; exits quietly (the host reports what went wrong)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the host's: it stops every stage
    try:
        _serve(spec)
    except Exception as exc:  # a peer gone or timed out: the host sees it too, and says why it stopped
        print(f"slotbench stage {spec.stage}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}",
              file=sys.stderr, flush=True)
        os._exit(_exit_code(exc))


def _exit_code(exc: Exception) -> int:
    """A failure of the group's transport — gloo raises it (as a RuntimeError naming its source file) when a peer
    closes its socket or does not answer in time — makes this stage a casualty, the cause elsewhere: PEER_SILENT for
    a time-out, PEER_LOST otherwise. Anything else is this stage's own failure."""
    if not (isinstance(exc, dist.DistError) or "gloo" in str(exc)):
        return FAILED
    return PEER_SILENT if "Timed out" in str(exc) else PEER_LOST


def _serve(spec: StageSpec) -> None:
    torch.set_num_threads(max(1, spec.threads))
    pg, _store = connect(spec.port, spec.stage + 1, spec.stages + 1, spec.timeout_s)
    cfg, sz, s = spec.cfg, spec.sizes, spec.stage
    first, last = s == 0, s == spec.stages - 1
    model = StageModel(cfg, *spec.layers, first, last)
    missing, unexpected = model.load_state_dict(spec.state, strict=False)
    if unexpected or any(not (k.startswith(("embed_tokens", "lm_head", "norm"))) for k in missing):
        raise RuntimeError(f"stage {s}: weights do not match ({missing[:3]}, {unexpected[:3]})")
    model = script_model(model.to(cfg.torch_dtype).eval().requires_grad_(False))
    memory = DeviceMemory(torch.device("cpu"), split=False)
    stage_cfg = ModelConfig(**{**cfg.to_dict(), "num_hidden_layers": max(1, spec.layers[1] - spec.layers[0])})
    kv = KVCachePool(stage_cfg, sz["num_blocks"], sz["tokens_per_block"], memory)  # this stage's layers only
    # the host KV tier's blocks of this stage's layers (each stage moves its own share, as a TP rank would)
    host = KVHostPool(stage_cfg, sz["kv_offload_blocks"], sz["tokens_per_block"], memory) \
        if sz["kv_offload_blocks"] else None
    state = DecoderState(sz["num_slots"], MAX_STOP_IDS, memory) if last else None
    max_blocks = -(-sz["max_seq_len"] // sz["tokens_per_block"])
    n_ints = m.max_ints(sz["max_tokens"], sz["max_batch"], max_blocks, MAX_STOP_IDS, sz["max_copies"])
    sets = [{"header": torch.zeros(m.HEADER, dtype=torch.int64), "ints": torch.zeros(n_ints, dtype=torch.int64),
             "floats": torch.zeros(sz["max_batch"] * 4), "hidden": torch.zeros(sz["max_tokens"], cfg.hidden_size,
                                                                               dtype=cfg.torch_dtype)}
            for _ in range(sz["num_buffer_sets"])]
    header = torch.zeros(m.HEADER, dtype=torch.int64)
    logits = torch.zeros(sz["max_batch"], cfg.vocab_size)  # [B, V] float32, as the engine's
    out = torch.zeros(sz["max_batch"], 2, dtype=torch.int64)  # [R, 2] token, finish code
    times = torch.zeros(3, dtype=torch.float64)  # compute start, forward end, sample end (perf_counter)
    pending: list = []  # sends whose buffers must outlive them
    with torch.inference_mode():
        while True:
            pg.recv([header], HOST, 0).wait(HOST_IDLE)  # (not --stage-timeout: the host may have no work for long)
            if int(header[m.KIND]) == m.STOP:
                break
            b = sets[int(header[m.SET])]
            b["header"].copy_(header)
            pg.recv([b["ints"][:int(header[m.INTS])]], HOST, 0).wait()
            if last and int(header[m.FLOATS]):
                pg.recv([b["floats"][:int(header[m.FLOATS])]], HOST, 0).wait()
            msg = m.Unpacked(b["header"], b["ints"], b["floats"], ADMIT_INTS + MAX_STOP_IDS)
            if msg.fault[0] == s:  # test hooks: this stage dies, or stops answering
                if msg.fault[1] == m.DIE:
                    os._exit(3)
                time.sleep(3600)
            hidden = b["hidden"][:msg.num_tokens]
            for w in pending:  # the buffer may still be on its way to the next stage
                w.wait()
            pending.clear()
            if not first:
                pg.recv([hidden], s, 0).wait()  # stage s - 1 is rank s
            times[0] = time.perf_counter()
            if host is not None and (len(msg.offload) or len(msg.onload)):  # before the forward, as the engine's
                host.move(msg.offload[:, 0], msg.offload[:, 1].tolist(), msg.onload[:, 0].tolist(), msg.onload[:, 1],
                          kv.k, kv.v)
            model.step(msg.tokens, msg.block_table, msg.ctx_starts, msg.ctx_lens, msg.ctx_pos0, msg.num_ctx_tokens,
                       msg.gen_kmax, sz["tokens_per_block"], msg.rows, hidden, hidden, kv.k, kv.v, logits)
            times[1] = time.perf_counter()
            if last:
                a = msg.admit
                if a.size(0):
                    state.admit(a[:, 0], a[:, 1:], msg.admit_f)
                n = msg.num_outputs
                state.sample(logits[:msg.num_samples], msg.slots, out[:n], msg.use_filters, msg.any_random)
                times[2] = time.perf_counter()
                pg.send([out[:n]], HOST, 0).wait()
            else:
                times[2] = times[1]
                pending.append(pg.send([hidden], s + 2, 0))  # stage s + 1 is rank s + 2
            pg.send([times], HOST, 0).wait()
