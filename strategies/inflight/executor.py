"""In-flight batching: iteration-level scheduling; each request holds a slot from admission to finish.

Every iteration admits waiting requests into free slots, runs context and generation requests in one
forward, and releases a slot in the iteration its request finishes. The host waits for each step
before scheduling the next one: the loop is ``Strategy._loop``, the synchronous arrangement.
"""

from __future__ import annotations

from strategies.base import Strategy
from strategies.runtime.batch import ScheduledBatch
from strategies.runtime.buffers.buffer_set import BufferSet
from strategies.runtime.device.factory import make_stream
from strategies.runtime.device.stream import DeviceWork
from strategies.runtime.engine import Engine
from strategies.runtime.iteration import IterationRecord
from strategies.runtime.request import Request
from strategies.runtime.spec.draft_model import DraftModel, load_draft_model
from strategies.scheduler import IterationScheduler


class InflightStrategy(Strategy):
    name = "inflight"
    speculates = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.scheduler = IterationScheduler(self.config, self.kv, self.cross_kv)
        # max-utilization takes blocks as tokens need them, so those past rejected drafts go back at once;
        # guaranteed-no-evict's are the request's reservation to its end (static's: to its batch's end)
        self.trims_rejected_kv = not self.scheduler.guaranteed
        spec = self.config.speculative
        self.drafter: DraftModel | None = None  # on the simulated device the draft's passes are priced instead
        if spec is not None and spec.method == "draft_model" and self.config.device != "sim":
            try:
                self.drafter = self._draft_model()
            except BaseException:
                super().close()
                raise

    def _draft_model(self) -> DraftModel:
        """The draft model's engine, on a device stream of its own (``spec/draft_model.py``)."""
        c = self.config
        assert c.speculative is not None and c.speculative.model is not None
        cfg, model = load_draft_model(c.speculative.model, self.model_cfg, c.compile)
        stream = make_stream(c.device, self.clock, self.nvtx, c.device_threads, c.memory, c.cpu_device)
        try:
            engine = stream.build_engine(Engine, cfg, model, num_slots=c.max_batch_size, max_seq_len=c.max_seq_len,
                                         max_tokens=c.max_batch_size * c.max_seq_len, max_batch=c.max_batch_size,
                                         num_buffer_sets=1, num_blocks=c.total_kv_blocks,
                                         tokens_per_block=c.tokens_per_block)
        except BaseException:
            stream.close()
            raise
        stream.ready()
        return DraftModel(engine, stream)

    def _launch(self, rec: IterationRecord, batch: ScheduledBatch, bufs: BufferSet) -> DeviceWork:
        if self.drafter is not None and batch.verify:  # the draft's passes first: the step verifies their tokens
            rec.draft_start_s = self.clock.now()
            self.drafter.propose(batch.verify, self.kv.tables)
            rec.draft_end_s = self.clock.now()
        return super()._launch(rec, batch, bufs)

    def close(self) -> None:
        if self.drafter is not None:
            self.drafter.close()
        super().close()

    def schedule(self, iteration: int) -> ScheduledBatch:
        return self.scheduler.schedule(iteration, self.waiting, self.running, self.slots.num_free,
                                       self._admit, self._preempt)

    def rejection(self, r: Request) -> str | None:
        reason = super().rejection(r)
        need = r.prompt_len + r.encoder_len  # an encoder input runs in the step that admits its request
        if reason is None and not self.config.chunked_prefill and need > self.config.max_num_tokens:
            reason = (f"prompt ({need} tokens, encoder input included) exceeds max_num_tokens "
                      f"({self.config.max_num_tokens}) without chunked prefill")
        return reason

    def _preempt(self, r: Request) -> None:
        self._release(r, "preempted")
        r.preempt()
        self.waiting.appendleft(r)
