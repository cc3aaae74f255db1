"""Speculative decoding with a draft model (static, in-flight, overlap): a second engine proposes the drafts of
a step's verifying rows just before the step is launched (``strategies/runtime/spec/draft_model.py``). Under
overlap that is while the previous step runs, and a row whose last token is still on the device drafts past the
draft's guess of it.
On the simulated device the draft's passes are priced by the cost model instead, and no engine is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from strategies.base import Strategy
from strategies.runtime.batch import ScheduledBatch
from strategies.runtime.buffers.buffer_set import BufferSet
from strategies.runtime.device.stream import DeviceWork
from strategies.runtime.iteration import IterationRecord

if TYPE_CHECKING:
    from strategies.runtime.spec.draft_model import DraftModel


class DraftingStrategy(Strategy):
    """A strategy whose verifying steps may take their drafts from a draft model's engine."""

    drafter: DraftModel | None = None

    def _start_drafter(self) -> None:
        """Build the draft engine if the config asks for one (call at the end of ``__init__``)."""
        spec = self.config.speculative
        if spec is None or spec.method != "draft_model" or self.config.device == "sim":
            return
        try:
            self.drafter = self._draft_model()
        except BaseException:
            super().close()
            raise

    def _draft_model(self) -> DraftModel:
        """The draft model's engine, on a device stream of its own, sized like the target's."""
        from strategies.runtime.spec.draft_model import DraftModel, load_draft_model  # torch: not on sim

        c = self.config
        assert c.speculative is not None and c.speculative.model is not None
        cfg, model = load_draft_model(c.speculative.model, self.model_cfg, c.compile)
        # its first pass takes in every verifying row's unseen tokens (a whole prompt at first): room for all
        sizes = {"num_slots": c.max_batch_size, "max_seq_len": c.max_seq_len, "max_tokens": c.max_batch_size
                 * c.max_seq_len, "max_batch": c.max_batch_size,
                 "num_buffer_sets": c.speculative.num_speculative_tokens + 1,  # a set per pass (overlap: k + 1)
                 "num_blocks": c.total_kv_blocks, "tokens_per_block": c.tokens_per_block}
        stream, engine = Strategy._local_engine(self, sizes, cfg, model)  # never a subclass's own extras
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
            self.drafter = None
        super().close()
