"""The two roles a disaggregated deployment's workers play, each a part given to the in-flight strategy on an
engine of its own (slots, KV pool, buffers, device stream: the runtime's, unchanged).

- ``PrefillRole`` (a context executor, TensorRT-LLM's context-only requests): its worker prefills, samples the
  first token and hands the request over. From then on it computes nothing more for it but holds its slot and
  blocks until the transceiver says its KV has left (TensorRT-LLM's ``DISAGG_CONTEXT_TRANS_IN_PROGRESS``).
- ``DecodeRole`` (a generation executor): takes a slot and blocks for a request *before* its KV arrives
  (SGLang's prealloc queue), so a transfer never lands where there is no room; once it has arrived the
  request runs as if its prompt had been read from the prefix cache: the one token left — the first token,
  whose KV nobody has computed yet — is a one-token chunk that samples the second (vLLM's arrangement on its
  decode instances). Its decoder-state row is reset by that step with the request's progress (one token
  generated), so sampling continues from the same counter as it would have on one engine.

Both add a KV staging buffer to their engine (``kv_transfer/staging.py``).
"""

from __future__ import annotations

from strategies.config import ExecutorConfig
from strategies.core.replica_role import ReplicaRole
from strategies.runtime.batch import ScheduledBatch
from strategies.runtime.kv_transfer.staging import block_bytes
from strategies.runtime.models.config import ModelConfig
from strategies.runtime.request import Request


def staging_blocks(model_cfg: ModelConfig, config: ExecutorConfig) -> int:
    """Blocks a worker's staging buffer holds (at least one, whatever --kv-transfer-buffer-mb says)."""
    return max(1, config.disagg.staging_bytes // block_bytes(model_cfg, config.tokens_per_block))


class PrefillRole(ReplicaRole):
    kind = "prefill"
    decodes = False  # a request leaves at its first token

    def __init__(self, index: int = 0) -> None:
        super().__init__(index)
        self.sending: list[Request] = []  # handed over, slot and blocks held until their KV has left

    def engine_sizes(self, model_cfg: ModelConfig, config: ExecutorConfig) -> dict[str, int]:
        return {"kv_staging_blocks": staging_blocks(model_cfg, config)}

    def hand_off(self) -> list[Request]:
        """After a step: the requests whose first token was read leave the running list (never scheduled here
        again) for the transceiver, their KV still held here."""
        scheduler = self.worker.scheduler
        out = [r for r in scheduler.running if r.num_output_tokens and not r.pending_samples]
        for r in out:
            scheduler.hand_off(r)
        self.sending.extend(out)
        return out

    def load(self) -> int:
        """Prompt tokens still to compute: all a prefill worker will compute for its requests."""
        w = self.worker
        return sum(r.context_target - r.num_computed_tokens if r.slot is not None else r.prompt_len
                   for r in (*w.waiting, *w.running))

    def sent(self, r: Request) -> None:
        """``r``'s KV has left: its slot and blocks go back (prefix caching keeps full blocks reusable)."""
        self.sending.remove(r)
        self.worker.scheduler.release(r, "handed off")

    def requests(self) -> list[Request]:
        return [*super().requests(), *self.sending]

    def fail_all(self, reason: str) -> list[Request]:
        failed = super().fail_all(reason)  # requests() counts the ones being sent
        self.sending.clear()
        return failed


class DecodeRole(ReplicaRole):
    kind = "decode"

    def __init__(self, index: int = 0) -> None:
        super().__init__(index)
        self.receiving: dict[Request, int] = {}  # KV on its way: the slot preallocated for it
        self._arrived: list[Request] = []  # KV received, decoder-state row not reset yet
        self._first_out: list[Request] = []  # KV received, its first token not yet streamed to the client

    def engine_sizes(self, model_cfg: ModelConfig, config: ExecutorConfig) -> dict[str, int]:
        return {"kv_staging_blocks": staging_blocks(model_cfg, config)}

    def preallocate(self, r: Request) -> int | None:
        """A slot and blocks for ``r`` before its KV is sent, or None while there is no room (requests
        this worker preempted resume first). Blocks: the whole request under guaranteed-no-evict, the
        prompt and the first token under max-utilization (with its watermark)."""
        w = self.worker
        if w.waiting or not w.slots.num_free:
            return None
        reserve = w.policy.reservation(r, r.prompt_len + 1)
        if not w.policy.fits(r, [], reserve, busy=bool(w.running or self.receiving)):
            return None
        slot = w.slots.acquire(r.request_id, w.core.iteration, r.width)
        w.kv.admit(slot, [], reserve, r.width, r.prompt_len)
        self.receiving[r] = slot
        return slot

    def received(self, r: Request) -> None:
        """``r``'s prompt KV is in its preallocated blocks: it runs from the next schedule."""
        w = self.worker
        slot = self.receiving.pop(r)
        w.scheduler.adopt(r, slot, r.prompt_len)  # computed: the prompt; left: the first token
        self._arrived.append(r)
        self._first_out.append(r)

    def stream_first_tokens(self) -> None:
        """After a step: a request's first output here (its second token) is when a client behind a proxy gets
        its first token — vLLM's disaggregated proxy streams the decode instance's output, and the decode
        instance's first step is this one (``Request.first_token_to_client``; the prefill worker's time is kept
        as ``prefill_first_token_s``)."""
        waiting = []
        for r in self._first_out:
            if r.num_output_tokens >= 2:
                r.first_token_to_client(r.token_times_s[1])
            elif not r.status.terminal:  # (failed here: it keeps the prefill worker's time)
                waiting.append(r)
        self._first_out = waiting

    def cancel(self, r: Request) -> None:
        """The transfer will not complete (its sender died): the preallocation goes back."""
        w = self.worker
        slot = self.receiving.pop(r)
        w.kv.release(slot, r)
        w.slots.release(slot, r.request_id, w.scheduler.last_scheduled, "cancelled")

    def scheduled(self, batch: ScheduledBatch) -> None:
        """A request's first step here resets its decoder-state row: it counts as admitted in that step."""
        if self._arrived:
            for r in self._arrived:
                if r.slot is not None and r.pending_samples:
                    batch.admitted.append(r)
            self._arrived = [r for r in self._arrived if r.slot is not None and not r.pending_samples]

    def requests(self) -> list[Request]:
        return [*super().requests(), *self.receiving]

    def fail_all(self, reason: str) -> list[Request]:
        failed = super().fail_all(reason)  # requests() counts the ones being received
        self.receiving.clear()
        return failed
