"""The drafter part: a draft model's engine for a strategy whose verifying steps take their drafts from one
(static, in-flight, overlap; ``strategies/runtime/spec/draft_model.py``). The strategy runs its passes just
before a verifying step is launched (``Strategy.launch``); under overlap that is while the previous step runs,
and a row whose last token is still on the device drafts past the draft's guess of it.

No drafter is built for n-gram drafts (the scheduling policy finds them in the request's own tokens) nor on
the simulated device, where the cost model prices the draft's passes instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from strategies.config import ExecutorConfig
from strategies.runtime.models.config import ModelConfig

if TYPE_CHECKING:
    import torch

    from strategies.runtime.spec.draft_model import DraftModel

LocalEngine = Callable[[dict, ModelConfig, "torch.nn.Module"], tuple]  # sizes, model config, model → (stream, engine)


def build_drafter(c: ExecutorConfig, target: ModelConfig, local_engine: LocalEngine) -> DraftModel | None:
    """The draft model's engine, on a device stream of its own (``local_engine``: the strategy's way to build
    one), sized like the target's; None where the config asks for none."""
    spec = c.speculative
    if spec is None or spec.method != "draft_model" or c.device == "sim":
        return None
    from strategies.runtime.spec.draft_model import DraftModel, load_draft_model  # torch: not on sim

    assert spec.model is not None
    cfg, model = load_draft_model(spec.model, target, c.compile)
    # its first pass takes in every verifying row's unseen tokens (a whole prompt at first): room for all
    sizes = {"num_slots": c.max_batch_size, "max_seq_len": c.max_seq_len, "max_tokens": c.max_batch_size
             * c.max_seq_len, "max_batch": c.max_batch_size,
             "num_buffer_sets": spec.num_speculative_tokens + 1,  # a set per pass (overlap: k + 1)
             "num_blocks": c.total_kv_blocks, "tokens_per_block": c.tokens_per_block}
    stream, engine = local_engine(sizes, cfg, model)
    stream.ready()
    return DraftModel(engine, stream)
