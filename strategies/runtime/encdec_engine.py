"""The engine for encoder–decoder models: an ``encode`` piece before the decoder's forward, and a
cross-attention KV pool beside the self-attention one.

A step that admits requests runs their encoder inputs first (``encode``, its own device piece and NVTX
range, with its own buffers: ``buffers/encoder_buffers.py``); the decoder's forward then projects each admitted
request's encoder output into its cross-KV pages and attends to them, as every later step does through
the request's row of the cross block table. The host side is the engine's: the strategy's scheduler
counts encoder tokens against the step's budget and cross blocks against their own pool.
"""

from __future__ import annotations

import torch

from strategies.runtime.buffers.buffer_set import BufferSet
from strategies.runtime.device.stream import DeviceStream, DeviceWork
from strategies.runtime.engine import Engine
from strategies.runtime.kv.pool import KVCachePool
from strategies.runtime.models.config import ModelConfig


class EncoderDecoderEngine(Engine):
    def __init__(self, cfg: ModelConfig, model: torch.nn.Module, stream: DeviceStream, *, cross_blocks: int,
                 **sizes: int) -> None:
        super().__init__(cfg, model, stream, **sizes)
        # [L, H, cross pages, D] keys, values (each buffer set's encoder buffers: Engine's, as on every device)
        self.cross = KVCachePool(cfg, cross_blocks, sizes["tokens_per_block"], stream.memory)

    @property
    def kv_bytes(self) -> int:
        return super().kv_bytes + self.cross.nbytes

    def launch(self, iteration: int, bufs: BufferSet) -> DeviceWork:
        pieces = [("forward", self._forward, (iteration, bufs)), ("sample", self._sample, (bufs,))]
        if bufs.encoder is not None and bufs.encoder.num_tokens:
            pieces.insert(0, ("encode", self._encode, (bufs,)))
        return self.stream.enqueue(iteration, pieces)

    def _encode(self, bufs: BufferSet) -> None:
        enc = bufs.encoder
        assert enc is not None
        enc.upload_encoder()
        tokens = enc.tokens.dev[:enc.num_tokens]  # [E, 2]
        enc.output[:enc.num_tokens] = self.model.encode(tokens[:, 0], tokens[:, 1], enc.starts, enc.lens)

    def _step_model(self, bufs: BufferSet) -> None:
        rb, enc = bufs.runtime, bufs.encoder
        assert enc is not None  # (its cross-attention inputs were uploaded with every family's, in the forward)
        self.model.step(rb.tokens.dev[:rb.num_tokens], rb.device_block_table(), rb.ctx_starts, rb.ctx_lens,
                        rb.ctx_pos0, rb.num_ctx_tokens, rb.gen_kmax, self.tokens_per_block,
                        rb.rows.dev[:rb.num_samples], self.state.last_token_rows, self._k, self._v, rb.logits,
                        self.state.indirection, self.state.max_beam, enc.output[:enc.num_fill],
                        enc.fill.dev[:enc.num_fill], self.cross.k, self.cross.v, enc.device_cross_table(),
                        enc.cross_lens, enc.cross_len.dev[:len(enc.cross_lens)], max(enc.cross_lens, default=0))
