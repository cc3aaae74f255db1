"""``hf-static``: transformers ``generate`` over left-padded static batches of ``max_batch_size``.

Token times come from generate itself: a streamer timestamps every step's tokens as generate emits them.
"""

from __future__ import annotations

import torch
from transformers.generation.streamers import BaseStreamer

from strategies.peers.hf_model import PeerExecutor
from strategies.runtime.device.clock import Clock
from strategies.runtime.iteration import IterationRecord
from strategies.runtime.request import Request, Status


class _StepTimes(BaseStreamer):
    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # generate first hands over the prompt
            self._prompt_seen = True
            return
        self.times.append(self.clock.now())

    def end(self) -> None:
        pass


class HFStaticExecutor(PeerExecutor):
    name = "hf-static"

    def run(self, source) -> None:
        self.source = source
        waiting: list[Request] = []
        iteration = 0
        while True:
            waiting += self.arrivals(source)
            if not waiting:
                if not self.idle_until_arrival(source):
                    return
                continue
            batch, waiting = waiting[: self.config.max_batch_size], waiting[self.config.max_batch_size:]
            self._generate(iteration, batch)
            iteration += 1

    def _generate(self, iteration: int, batch: list[Request]) -> None:
        rec = IterationRecord(iteration, schedule_start_s=self.clock.now())
        longest = max(r.prompt_len for r in batch)
        ids = torch.zeros((len(batch), longest), dtype=torch.long)  # left padding, as generate requires
        mask = torch.zeros_like(ids)
        for i, r in enumerate(batch):
            ids[i, longest - r.prompt_len:] = torch.from_numpy(r.prompt_token_ids)
            mask[i, longest - r.prompt_len:] = 1
        eos = None if all(r.sampling.ignore_eos for r in batch) else self.model_cfg.eos_token_id
        streamer = _StepTimes(self.clock)
        rec.schedule_end_s = rec.forward_start_s = self.clock.now()
        with torch.inference_mode():
            out = self.hf.generate(ids, attention_mask=mask, max_new_tokens=max(r.max_new_tokens for r in batch),
                                   do_sample=False, eos_token_id=eos, pad_token_id=0, streamer=streamer)
        # generate is one opaque call: its whole span is the "forward" (sampling happens inside it)
        rec.forward_end_s = rec.sample_start_s = rec.sample_end_s = rec.postprocess_start_s = self.clock.now()
        new = out[:, longest:].tolist()
        for r, tokens in zip(batch, new, strict=True):
            tokens = tokens[: r.max_new_tokens]
            reason = "length"
            if eos is not None and not r.sampling.ignore_eos and eos in tokens:
                tokens, reason = tokens[: tokens.index(eos) + 1], "stop"
            for tok, t in zip(tokens, streamer.times, strict=False):
                r.append_token(tok, t)
            r.end(Status.FINISHED, reason)
            self.source.on_finished(r)
        rec.postprocess_end_s = self.clock.now()
        rec.num_context_requests = rec.active_slots = len(batch)
        rec.num_tokens = len(batch) * (longest + len(streamer.times))
        rec.num_padding_tokens = sum(longest - r.prompt_len + len(streamer.times) - r.num_output_tokens
                                     for r in batch)
        rec.num_samples = len(batch) * len(streamer.times)
        self.records.append(rec)
