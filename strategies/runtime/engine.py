"""The engine: one forward + sample over a scheduled batch, enqueued on the device stream.

It owns what lives on the device — model weights, KV storage, decoder state — and a small number of
buffer sets (runtime buffers + decoder step I/O). The host prepares a set, launches it, and later
reads its outputs; the engine never decides *when* — that is the strategy's whole job.
"""

from __future__ import annotations

import warnings

import torch

from strategies.runtime.batch import BatchWork, ScheduledBatch
from strategies.runtime.decoder_state import DecoderState
from strategies.runtime.device import DeviceStream, DeviceWork
from strategies.runtime.kv_cache import KVCacheStorage
from strategies.runtime.model import LlamaModel, ModelConfig
from strategies.runtime.runtime_buffers import RuntimeBuffers
from strategies.runtime.step_io import StepIO

MAX_STOP_IDS = 8  # EOS plus up to seven per-request stop ids


class BufferSet:
    """One in-flight step's buffers: engine inputs/outputs plus decoder step inputs/outputs."""

    def __init__(self, index: int, runtime: RuntimeBuffers, step: StepIO) -> None:
        self.index = index
        self.runtime = runtime
        self.step = step
        self.work: BatchWork | None = None  # the batch's size in cost-model units (records, simulated device)


def script_model(model: LlamaModel) -> torch.nn.Module:
    """The model as one TorchScript module, so that its forward runs as one GIL-free call."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return torch.jit.script(model)


class Engine:
    def __init__(self, cfg: ModelConfig, model: torch.nn.Module, stream: DeviceStream, *, num_slots: int,
                 max_seq_len: int, max_tokens: int, max_batch: int, num_buffer_sets: int) -> None:
        if max_seq_len > cfg.max_position_embeddings:
            raise ValueError(f"max_seq_len {max_seq_len} exceeds the model's max_position_embeddings "
                             f"{cfg.max_position_embeddings}")
        self.cfg = cfg
        self.model = model
        self.stream = stream
        self.max_seq_len = max_seq_len
        self.kv = self._kv_storage(num_slots, max_seq_len)
        empty = torch.empty(0, device=stream.device)
        self._k, self._v = (self.kv.k, self.kv.v) if self.kv is not None else (empty, empty)
        self.state = DecoderState(num_slots, MAX_STOP_IDS, stream.device)
        self.buffer_sets = [
            BufferSet(i, RuntimeBuffers(max_tokens, max_batch, max_seq_len, cfg.vocab_size, stream,
                                        cfg.torch_dtype),
                      StepIO(max_batch, MAX_STOP_IDS, stream))
            for i in range(num_buffer_sets)
        ]
        self.fault_at_iteration: int | None = None  # test hook: the device step raises at this iteration

    def _kv_storage(self, num_slots: int, max_seq_len: int) -> KVCacheStorage | None:
        return KVCacheStorage(self.cfg, num_slots, max_seq_len, self.stream.device)

    def prepare(self, batch: ScheduledBatch, bufs: BufferSet) -> None:
        """Host side: write the batch into the set's host buffers."""
        bufs.runtime.fill(batch)
        bufs.step.fill(batch, self.cfg.eos_token_id)
        bufs.work = batch.work()

    def launch(self, iteration: int, bufs: BufferSet) -> DeviceWork:
        """Enqueue forward and sample for ``bufs``; returns at once."""
        return self.stream.enqueue(iteration, [("forward", lambda: self._forward(iteration, bufs)),
                                               ("sample", lambda: self._sample(bufs))])

    def outputs(self, bufs: BufferSet) -> tuple[list[int], list[int]]:
        """Sampled tokens and finish codes per row; valid once the step's work is waited for."""
        n = len(bufs.step.rows)
        out = bufs.step.host_out[:, :n].tolist()
        return out[0], out[1]

    def _forward(self, iteration: int, bufs: BufferSet) -> None:
        if self.fault_at_iteration is not None and iteration >= self.fault_at_iteration:
            raise RuntimeError(f"injected engine fault at iteration {iteration}")
        rb, io = bufs.runtime, bufs.step
        rb.to_device(self.stream)
        io.to_device(self.stream)
        if io.num_admit:
            a = io.dev_admit[:io.num_admit]
            self.state.admit(a[:, 0], a[:, 1:], io.dev_admit_f[:io.num_admit])
        n = rb.num_tokens
        # Generation inputs come from the decoder state on the device, never from the host.
        self.model.step(rb.dev[0, :n], rb.dev[1, :n], rb.dev[2, :n], self._k, self._v, rb.ctx_starts,
                        rb.ctx_lens, rb.ctx_slots, rb.ctx_pos0, rb.num_ctx_tokens, rb.gen_kmax,
                        rb.dev_rows[:rb.num_samples], self.state.last_token, rb.logits)

    def _sample(self, bufs: BufferSet) -> None:
        rb, io, st = bufs.runtime, bufs.step, self.state
        n = rb.num_samples
        if n == 0:
            return
        st.sample(rb.logits[:n], io.dev_slots[:n], io.dev_out[:, :n], io.use_filters, io.any_random)
        io.outputs_to_host(self.stream)
