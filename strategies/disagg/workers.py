"""The two kinds of executor a disaggregated deployment is made of, each the in-flight strategy on an
engine of its own (slots, KV pool, buffers, device stream: the runtime's, unchanged).

- ``PrefillWorker`` (a context executor, TensorRT-LLM's context-only requests): prefills, samples the first
  token and hands the request over. From then on it computes nothing more for it but holds its slot and
  blocks until the transceiver says its KV has left (TensorRT-LLM's ``DISAGG_CONTEXT_TRANS_IN_PROGRESS``).
- ``DecodeWorker`` (a generation executor): takes a slot and blocks for a request *before* its KV arrives
  (SGLang's prealloc queue), so a transfer never lands where there is no room; once it has arrived the
  request runs as if its prompt had been read from the prefix cache: the one token left — the first token,
  whose KV nobody has computed yet — is a one-token chunk that samples the second (vLLM's arrangement on its
  decode instances). Its decoder-state row is reset by that step with the request's progress (one token
  generated), so sampling continues from the same counter as it would have on one engine.
"""

from __future__ import annotations

from strategies.fleet import Worker
from strategies.runtime.batch import ScheduledBatch
from strategies.runtime.buffers.buffer_set import BufferSet
from strategies.runtime.iteration import IterationRecord
from strategies.runtime.kv_transfer.staging import block_bytes
from strategies.runtime.request import Request


class DisaggWorker(Worker):
    """A fleet worker whose engine has a KV staging buffer."""

    def staging_blocks(self) -> int:
        """Blocks the staging buffer holds (at least one, whatever --kv-transfer-buffer-mb says)."""
        size = block_bytes(self.model_cfg, self.config.tokens_per_block)
        return max(1, self.config.disagg.staging_bytes // size)

    def _local_engine(self, sizes: dict) -> tuple:
        return super()._local_engine({**sizes, "kv_staging_blocks": self.staging_blocks()})


class PrefillWorker(DisaggWorker):
    name = "disagg-prefill"
    role = "prefill"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.handoffs: list[Request] = []  # first token read: for the transceiver, KV still held here
        self.sending: list[Request] = []  # handed over, slot and blocks held until their KV has left

    def _postprocess(self, rec: IterationRecord, bufs: BufferSet) -> None:
        super()._postprocess(rec, bufs)
        for r in [r for r in self.running if r.num_output_tokens and not r.pending_samples]:
            self.running.remove(r)  # never scheduled here again
            self.sending.append(r)
            self.handoffs.append(r)

    def load(self) -> int:
        """Prompt tokens still to compute: all a prefill worker will compute for its requests."""
        return sum(r.context_target - r.num_computed_tokens if r.slot is not None else r.prompt_len
                   for r in (*self.waiting, *self.running))

    def sent(self, r: Request) -> None:
        """``r``'s KV has left: its slot and blocks go back (prefix caching keeps full blocks reusable)."""
        self.sending.remove(r)
        self._release(r, "handed off")

    def requests(self) -> list[Request]:
        return [*super().requests(), *self.sending]

    def fail_all(self, reason: str) -> list[Request]:
        failed = super().fail_all(reason)  # requests() counts the ones being sent
        self.sending.clear()
        self.handoffs.clear()
        return failed


class DecodeWorker(DisaggWorker):
    name = "disagg-decode"
    role = "decode"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.receiving: dict[Request, int] = {}  # KV on its way: the slot preallocated for it
        self._arrived: list[Request] = []  # KV received, decoder-state row not reset yet

    def preallocate(self, r: Request) -> int | None:
        """A slot and blocks for ``r`` before its KV is sent, or None while there is no room (requests
        this worker preempted resume first). Blocks: the whole request under guaranteed-no-evict, the
        prompt and the first token under max-utilization (with its watermark)."""
        if self.waiting or not self.slots.num_free:
            return None
        sched = self.scheduler
        reserve = r.prompt_len + (r.max_new_tokens if sched.guaranteed else 1)
        spare = sched.watermark if self.running or self.receiving else 0
        if self.kv.admission_blocks([], reserve, r) > self.kv.free_blocks - spare:
            return None
        slot = self.slots.acquire(r.request_id, self.next_iteration, r.width)
        self.kv.admit(slot, [], reserve, r.width, r.prompt_len)
        self.receiving[r] = slot
        return slot

    def received(self, r: Request) -> None:
        """``r``'s prompt KV is in its preallocated blocks: it runs from the next schedule."""
        slot = self.receiving.pop(r)
        r.admit(slot, self._admissions, r.prompt_len, book=self.progress)  # computed: the prompt; left: the first token
        self._admissions += 1
        self.running.append(r)
        self._arrived.append(r)

    def cancel(self, r: Request) -> None:
        """The transfer will not complete (its sender died): the preallocation goes back."""
        slot = self.receiving.pop(r)
        self.kv.release(slot, r)
        self.slots.release(slot, r.request_id, self._last_scheduled, "cancelled")

    def schedule(self, iteration: int) -> ScheduledBatch:
        batch = super().schedule(iteration)
        if self._arrived:
            for r in self._arrived:
                if r.slot is not None and r.pending_samples:  # its first step here: reset its state row
                    batch.admitted.append(r)
            self._arrived = [r for r in self._arrived if r.slot is not None and not r.pending_samples]
        return batch

    def requests(self) -> list[Request]:
        return [*super().requests(), *self.receiving]

    def fail_all(self, reason: str) -> list[Request]:
        failed = super().fail_all(reason)  # requests() counts the ones being received
        self.receiving.clear()
        return failed
