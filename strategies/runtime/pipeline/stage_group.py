"""The host's side of a pipeline: the stage processes, and the engine and stream the strategy drives.

``PipelineEngine`` has the engine's interface (prepare, launch, outputs, buffer sets) so the strategy's
three parts stay the same; behind it, slotbench starts one process per stage (``torch.multiprocessing``,
spawned) in a ``torch.distributed`` group — gloo on CPU — with the host as rank 0. A launch sends the
micro-batch's message to every stage and posts receives for the last stage's tokens and every stage's
times; ``PipelineStream.wait`` waits for them. A stage that dies fails the wait at once (its socket
closes); one that hangs fails it after ``stage_timeout_s``. ``close`` stops every stage and leaves no
process behind, whatever state they are in.
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from strategies.runtime.batch import ScheduledBatch
from strategies.runtime.buffers.buffer_set import BufferSet, build_buffer_sets
from strategies.runtime.buffers.family import MAX_STOP_IDS, EngineSizes, StepFill
from strategies.runtime.buffers.memory import DeviceMemory
from strategies.runtime.buffers.runtime_buffers import ID
from strategies.runtime.device.clock import Clock
from strategies.runtime.device.nvtx import Nvtx
from strategies.runtime.device.stream import DeviceStream, DeviceWork
from strategies.runtime.models.config import ModelConfig
from strategies.runtime.pipeline import messages as m
from strategies.runtime.pipeline import stage_worker
from strategies.runtime.pipeline.stage_model import stage_layers, stage_state

EXIT_GRACE_S = 2.0  # a failed wait: how long a stage that died may take to be seen dead


class PipelineStream(DeviceStream):
    def __init__(self, clock: Clock, nvtx: Nvtx, engine: PipelineEngine) -> None:
        super().__init__(clock, nvtx, engine.memory)
        self.engine = engine

    def wait(self, work: DeviceWork) -> float:
        t = self.clock.now()
        try:
            for w in work.events:  # the sends, the last stage's tokens, every stage's times
                w.wait()
        except RuntimeError as exc:  # gloo's message names a socket; say which stage, and what happened to it
            raise RuntimeError(self.engine.what_failed(timed_out="Timed out" in str(exc))) from None
        waited = self.clock.now() - t
        times = self.engine.times_of(work.iteration)  # [stages, 3] perf_counter readings
        at = self.clock.at
        work.stages = [(at(s[0]), at(s[2] if i == len(times) - 1 else s[1])) for i, s in enumerate(times.tolist())]
        last = times[-1].tolist()
        work.times["forward"] = (at(float(times[0, 0])), at(last[1]))
        work.times["sample"] = (at(last[1]), at(last[2]))
        work.events.clear()
        if not work.done():
            work.finish()
        return waited

    def close(self) -> None:
        self.engine.shutdown()


class PipelineEngine:
    def __init__(self, cfg: ModelConfig, model: torch.nn.Module, clock: Clock, nvtx: Nvtx, *, stages: int,
                 timeout_s: float, threads: int, num_slots: int, max_seq_len: int, max_tokens: int, max_batch: int,
                 num_buffer_sets: int, num_blocks: int, tokens_per_block: int, max_beam: int = 1,
                 max_drafts: int = 0, kv_offload_blocks: int = 0) -> None:
        if max_drafts:  # the stages would each need the drafts and the accept step; not built
            raise ValueError("pipeline: speculative decoding is not supported")
        if stages > cfg.num_hidden_layers:
            raise ValueError(f"--pp {stages}: the model has only {cfg.num_hidden_layers} layers")
        self.cfg, self.stages, self.tokens_per_block, self.timeout_s = cfg, stages, tokens_per_block, timeout_s
        self.memory = DeviceMemory(torch.device("cpu"), split=False)  # the host's buffers; stages hold the rest
        # the families a decoder-only model without speculation keeps (runtime buffers, step I/O); stages hold the
        # device halves of their own (stage_worker.py)
        set_sizes = EngineSizes(num_slots, max_seq_len, max_tokens, max_batch, num_buffer_sets, num_blocks,
                                tokens_per_block, kv_offload_blocks=kv_offload_blocks)
        self.buffer_sets = build_buffer_sets(cfg, set_sizes, self.memory)
        copies = self.buffer_sets[0].kv_copies
        n_ints = m.max_ints(max_tokens, max_batch, -(-max_seq_len // tokens_per_block), MAX_STOP_IDS,
                            copies.capacity if copies is not None else 0)
        self._send = [(torch.zeros(m.HEADER, dtype=torch.int64), torch.zeros(n_ints, dtype=torch.int64),
                       torch.zeros(max_batch * 4)) for _ in range(num_buffer_sets)]
        self._sizes = [(0, 0)] * num_buffer_sets
        self._out = [torch.zeros(max_batch, 2, dtype=torch.int64) for _ in range(num_buffer_sets)]  # [R, 2]
        self._times = [torch.zeros(stages, 3, dtype=torch.float64) for _ in range(num_buffer_sets)]
        self._set_of: dict[int, int] = {}  # iteration → buffer set, while launched
        self.stage_fault: tuple[int, int, int] | None = None  # test hook: (stage, iteration, DIE | HANG)
        self.fault_at_iteration: int | None = None
        self.layer_ranges = stage_layers(cfg.num_hidden_layers, stages)
        self.kv_bytes = 2 * num_blocks * tokens_per_block * cfg.num_hidden_layers * cfg.num_key_value_heads \
            * cfg.head_dim * cfg.torch_dtype.itemsize  # all stages' pools together
        sizes = {"num_slots": num_slots, "max_seq_len": max_seq_len, "max_tokens": max_tokens, "max_batch": max_batch,
                 "num_buffer_sets": num_buffer_sets, "num_blocks": num_blocks, "tokens_per_block": tokens_per_block,
                 "kv_offload_blocks": kv_offload_blocks, "max_copies": copies.capacity if copies is not None else 0}
        full = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        store = dist.TCPStore("127.0.0.1", 0, stages + 1, is_master=True,  # port 0: the OS picks a free one
                              timeout=stage_worker.startup_timeout(timeout_s), wait_for_workers=False)
        port = store.port
        ctx = mp.get_context("spawn")
        self.procs = []
        for s, (a, b) in enumerate(self.layer_ranges):
            first, last = s == 0, s == stages - 1
            spec = stage_worker.StageSpec(cfg, stage_state(full, a, b, first, last), s, stages, (a, b), sizes, port,
                                          timeout_s, threads)
            p = ctx.Process(target=stage_worker.main, args=(spec,), name=f"slotbench-stage-{s}", daemon=True)
            p.start()
            self.procs.append(p)
        try:
            self.pg = stage_worker.join_group(store, 0, stages + 1, timeout_s, alive=self._started)
        except BaseException:
            self._kill()
            raise
        self._store = store
        self.stream = PipelineStream(clock, nvtx, self)

    @property
    def kv_block_bytes(self) -> int:
        return self.cfg.kv_bytes_per_token * self.tokens_per_block

    def prepare(self, batch: ScheduledBatch, bufs: BufferSet, block_table: np.ndarray,
                cross_table: np.ndarray | None = None) -> None:
        bufs.fill_step(StepFill(batch, batch.sampled_requests, block_table, None, self.cfg.eos_token_id))
        rb = bufs.runtime
        if batch.gen_requests:  # a request is in one micro-batch at a time: the host knows its input token
            ids = np.fromiter((r.token_ids[-1] for r in batch.gen_requests), np.int64, len(batch.gen_requests))
            rb.tokens.np[rb.num_ctx_tokens:rb.num_tokens, ID] = ids

    def launch(self, iteration: int, bufs: BufferSet) -> DeviceWork:
        self.stream.check_ready()
        header, ints, floats = self._send[bufs.index]
        fault = self.stage_fault[::2] if self.stage_fault and self.stage_fault[1] == iteration else (-1, 0)
        n_ints, n_floats = m.pack(iteration, bufs.index, bufs.runtime, bufs.step, header, ints, floats, fault,
                                  bufs.kv_copies)
        work = DeviceWork(iteration)
        for s in range(self.stages):
            sends = [header, ints[:n_ints]] + ([floats[:n_floats]] if s == self.stages - 1 and n_floats else [])
            work.events += [self.pg.send([t], s + 1, 0) for t in sends]  # kept until done: a dropped send is lost
        work.events.append(self.pg.recv([self._out[bufs.index][:len(bufs.step.rows)]], self.stages, 0))
        work.events += [self.pg.recv([self._times[bufs.index][s]], s + 1, 0) for s in range(self.stages)]
        self._set_of[iteration] = bufs.index
        return work

    def times_of(self, iteration: int) -> torch.Tensor:
        return self._times[self._set_of.pop(iteration)]

    def outputs(self, bufs: BufferSet) -> np.ndarray:
        """[R, 2] token, finish code per request (the last stage's message, received into host memory)."""
        return self._out[bufs.index][:len(bufs.step.rows)].numpy()

    def what_failed(self, timed_out: bool) -> str:
        """Why the host's wait failed. Timed out: a stage went silent (the stages behind it time out too, and
        exit). Otherwise a peer closed its socket: a stage died, and its process, which closes the socket
        as it exits, is given up to ``EXIT_GRACE_S`` to be seen dead. A stage that exited because its own
        peer went away is not the cause: the one that failed is named, though the casualty may be reaped
        first (a process's sockets close before its exit can be seen)."""
        timeout = f"pipeline: a stage did not answer within --stage-timeout ({self.timeout_s:g} s)"
        deadline = time.monotonic() + (0.0 if timed_out else EXIT_GRACE_S)
        dead: list[tuple[int, int]] = []
        while not timed_out:
            dead = [(s, p.exitcode) for s, p in enumerate(self.procs) if not p.is_alive()]
            cause = [d for d in dead if d[1] not in (stage_worker.PEER_LOST, stage_worker.PEER_SILENT)]
            if cause:
                return f"pipeline stage {cause[0][0]} exited (code {cause[0][1]})"
            if time.monotonic() >= deadline:
                break
            time.sleep(0.01)
        if dead and all(code != stage_worker.PEER_SILENT for _, code in dead):
            return f"pipeline stage {dead[0][0]} exited (code {dead[0][1]}: a peer closed its connection)"
        return timeout  # (or a stage behind a silent one timed out on it before the host did, and exited)

    def _started(self) -> None:
        """Raises if a stage process died while the group was forming."""
        for s, p in enumerate(self.procs):
            if not p.is_alive():
                raise RuntimeError(f"pipeline stage {s} exited during start-up (code {p.exitcode})")

    def shutdown(self) -> None:
        """Stop every stage: a stop message to the ones still listening, then whatever is left is killed."""
        stop = torch.zeros(m.HEADER, dtype=torch.int64)
        stop[m.KIND] = m.STOP
        if all(p.is_alive() for p in self.procs):
            try:
                sent = [self.pg.send([stop], s + 1, 0) for s in range(self.stages)]
                for p in self.procs:
                    p.join(timeout=2)
                del sent
            except RuntimeError:
                pass
        self._kill()

    def _kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
