"""``hf-cb``: transformers continuous batching (``init_continuous_batching``), fed open loop.

The KV cache is sized explicitly from the executor config (its default sizes it from host RAM), token
times are the manager's own per-token timestamps, and the manager — which runs a non-daemon thread — is
always stopped.
"""

from __future__ import annotations

from transformers import ContinuousBatchingConfig, GenerationConfig

from strategies.peers.hf_model import PeerExecutor
from strategies.runtime.request import Request, Status

POLL_S = 0.02  # longest the host blocks on results before it looks for new arrivals


class HFContinuousBatchingExecutor(PeerExecutor):
    name = "hf-cb"

    def run(self, source) -> None:
        self.source = source
        c = self.config
        gen = GenerationConfig(do_sample=False, max_new_tokens=c.max_seq_len, eos_token_id=self.model_cfg.eos_token_id,
                               pad_token_id=0)
        cb = ContinuousBatchingConfig(num_blocks=c.total_kv_blocks, max_batch_tokens=c.max_num_tokens,
                                      page_size=c.tokens_per_block, max_requests_per_batch=c.max_batch_size)
        manager = self.hf.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
        manager.start()
        outstanding: dict[str, Request] = {}
        try:
            while True:
                for r in self.arrivals(source):
                    outstanding[r.request_id] = r
                    manager.add_request(r.prompt_token_ids.tolist(), request_id=r.request_id,
                                        max_new_tokens=r.max_new_tokens, record_timestamps=True,
                                        eos_token_id=self.eos_for(r))
                if not outstanding:
                    if not self.idle_until_arrival(source):
                        return
                    continue
                nxt = source.next_arrival_s()
                wait = POLL_S if nxt is None else min(POLL_S, max(nxt - self.clock.now(), 0.0))
                result = manager.get_result(timeout=wait)
                if result is not None and result.is_finished() and result.request_id in outstanding:
                    self._complete(outstanding.pop(result.request_id), result)
        finally:
            manager.stop(block=True)

    def _complete(self, r: Request, result) -> None:
        if result.error:
            r.end(Status.FAILED, f"hf-cb: {result.error}", self.clock.now())
        else:
            times = [t - self.clock.t0 for t in (result.timestamps or [])]
            tokens = result.generated_tokens[: r.max_new_tokens]
            for i, tok in enumerate(tokens):
                r.append_token(tok, times[i] if i < len(times) else self.clock.now())
            stop = not r.sampling.ignore_eos and tokens and tokens[-1] == self.model_cfg.eos_token_id
            r.end(Status.FINISHED, "stop" if stop else "length")
        self.source.on_finished(r)
