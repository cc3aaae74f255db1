"""What a strategy asks of the parts it is given (``strategies/base.py``): a scheduling policy and, in a fleet,
a role. (The drafter is a ``DraftModel`` or None; the recorder is ``recorder.StepRecorder``.)"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from strategies.config import ExecutorConfig
    from strategies.runtime.batch import ScheduledBatch
    from strategies.runtime.models.config import ModelConfig
    from strategies.runtime.request import Request


Admit = Callable[["Request", list[int], int], None]  # (request, cached prefix blocks, tokens to reserve)
Preempt = Callable[["Request"], None]


class Queues(Protocol):
    """What a policy reads and changes of its scheduler (``core/scheduler.py``): the queue, the free slots, and
    the two calls that move a request between them."""

    waiting: deque[Request]

    @property
    def free_slots(self) -> int: ...

    def admit(self, r: Request, hits: list[int], reserve_tokens: int) -> None: ...

    def preempt(self, r: Request) -> None: ...


class Policy(Protocol):
    """A scheduling policy: ``scheduler.IterationScheduler``, ``static/batcher.StaticBatcher``."""

    trims_rejected_kv: bool  # blocks past rejected drafts go back at once (else they stay reserved)

    def schedule(self, iteration: int, queues: Queues, running: list[Request]) -> ScheduledBatch:
        """Step ``iteration``: rows for ``running`` (the running requests it may give rows this step) and for
        the requests it admits from ``queues``."""

    def rejection(self, r: Request) -> str | None:
        """Why this policy can never schedule ``r`` (beyond the executor's own limits), or None."""


class Role(Protocol):
    """A strategy as one worker of a fleet: ``fleet.ReplicaRole``, ``disagg/workers.py``'s prefill and decode."""

    label: str  # the worker's name in the records (prefill0, decode1, replica0)
    decodes: bool  # its worker computes tokens past a request's first (not a prefill worker)

    def attach(self, worker: object) -> None:
        """Called once, when the strategy's runtime exists."""

    def engine_sizes(self, model_cfg: ModelConfig, config: ExecutorConfig) -> dict[str, int]:
        """Engine sizes the role adds to the strategy's engine (a KV staging buffer)."""

    def scheduled(self, batch: ScheduledBatch) -> None:
        """Called as each of the strategy's schedules returns ``batch``."""
