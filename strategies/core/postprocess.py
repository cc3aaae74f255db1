"""A step's postprocess: each sampled token handed to its request, the finished ones finished.

Rows the device computed for a request it knew to be finished (static's done rows, overlap's one extra step)
are padding. A finished beam request's sequences are read back before its slot is let go. Rows that only
continue their request are handed out in the progress book at once (``runtime/progress.py``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from strategies.runtime.decoder.finish import CONTINUE, DISCARDED, FINISH_REASONS
from strategies.runtime.request import Request, Status
from strategies.speculation import receive_verified

if TYPE_CHECKING:
    from strategies.parts import Policy
    from strategies.runtime.buffers.buffer_set import BufferSet
    from strategies.runtime.device.clock import Clock
    from strategies.runtime.iteration import IterationRecord
    from strategies.runtime.kv.block_manager import BlockManager
    from strategies.runtime.progress import SlotProgress


class Receiver(Protocol):
    """What a postprocess reads and calls of its scheduler (``core/scheduler.py``)."""

    clock: Clock
    progress: SlotProgress
    policy: Policy
    kv: BlockManager

    def finish(self, r: Request, reason: str) -> None: ...


def hand_out(s: Receiver, engine: Any, rec: IterationRecord, bufs: BufferSet) -> None:
    """Step ``rec``'s outputs in ``bufs`` to their requests (``engine``: the runtime's, which reads them)."""
    out = engine.outputs(bufs)  # [R, 2] token, finish code
    io = bufs.step
    rows, n = io.rows, len(io.rows)
    # the host holds the tokens from here; a streaming client sees them after the serving path
    now = s.clock.client_time(s.clock.now(), n, s)  # (this engine's front end)
    beams_done: list[tuple[Request, int]] = []
    running = Status.RUNNING
    for i in s.progress.hand_out(io.slots.np[:n], io.keys[:n], out, now):
        r, tok, code = rows[i], int(out[i, 0]), int(out[i, 1])
        r.pending_samples -= 1
        if code == CONTINUE and r.status is running:
            r.append_token(tok, now)
            continue
        if code == DISCARDED:
            rec.num_padding_tokens += r.width
            continue
        if r.status.terminal:
            continue
        if r.width > 1 and r.status is Status.WAITING:  # preempted: the beam search starts over
            rec.num_padding_tokens += r.width
            continue
        r.append_token(tok, now)
        if code != CONTINUE:
            if r.width > 1:
                beams_done.append((r, code))
            else:
                s.finish(r, FINISH_REASONS[code])
    if bufs.drafts is not None and bufs.drafts.num_rows:
        for r, reason in receive_verified(rec, bufs.drafts, engine.verify_outputs(bufs), now,
                                          s.kv if s.policy.trims_rejected_kv else None):
            s.finish(r, reason)
    if beams_done:
        results = engine.read_beams(rec.iteration, [r for r, _ in beams_done])
        for (r, code), beams in zip(beams_done, results, strict=True):
            r.beams = beams
            s.finish(r, FINISH_REASONS[code])
