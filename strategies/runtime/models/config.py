"""The shapes of a model (Llama-style decoder, or BART encoder–decoder), and the presets built from a seed."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DTYPE_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}  # a model's dtypes, their sizes


ARCHITECTURES = ("llama", "bart")


@dataclass(frozen=True)
class ModelConfig:
    """Shapes of a model; field names follow Hugging Face's LlamaConfig. For BART (an encoder–decoder),
    hidden_size is d_model and the layer, head and FFN sizes are the decoder's; the encoder has
    ``encoder_layers`` layers of the same width (BartConfig's encoder_* sizes must equal the decoder's)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    eos_token_id: int = 2
    dtype: str = "float32"
    seed: int = 0  # seeds the random weights of a preset; unused for a loaded checkpoint
    architecture: str = "llama"  # llama (decoder-only, RoPE, RMSNorm) | bart (encoder–decoder, learned positions)
    encoder_layers: int = 0  # bart: encoder layers
    decoder_start_token_id: int = 2  # bart: the decoder's first input when a request gives no decoder prompt
    scale_embedding: bool = False  # bart: embeddings scaled by sqrt(d_model)
    layer_norm_eps: float = 1e-5  # bart's LayerNorms
    # Mixture of experts (Mixtral's sparse MLP): each layer's MLP is num_local_experts experts of
    # intermediate_size, each token routed to num_experts_per_tok of them; 0: a dense MLP
    num_local_experts: int = 0
    num_experts_per_tok: int = 0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "intermediate_size", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model config: {name} must be positive, got {getattr(self, name)}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("model config: hidden_size must be a multiple of num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("model config: num_attention_heads must be a multiple of num_key_value_heads")
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"model config: architecture must be one of {ARCHITECTURES}, got {self.architecture!r}")
        if self.architecture == "llama" and self.head_dim % 2:
            raise ValueError("model config: head_dim must be even for RoPE")
        if self.is_encoder_decoder and self.encoder_layers <= 0:
            raise ValueError("model config: an encoder–decoder model needs encoder_layers > 0")
        if self.num_local_experts or self.num_experts_per_tok:
            if not 1 <= self.num_experts_per_tok <= self.num_local_experts:
                raise ValueError("model config: a mixture of experts needs 1 <= num_experts_per_tok <= "
                                 f"num_local_experts, got {self.num_experts_per_tok} of {self.num_local_experts}")
            if self.is_encoder_decoder:
                raise ValueError("model config: experts are supported in Llama-style decoders only")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"model config: dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")
        if not 0 <= self.eos_token_id < self.vocab_size:
            raise ValueError("model config: eos_token_id must be inside the vocabulary")

    @property
    def is_encoder_decoder(self) -> bool:
        return self.architecture == "bart"

    @property
    def is_moe(self) -> bool:
        return self.num_local_experts > 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch  # here, not above: a simulated run reads configs and never imports torch

        return getattr(torch, self.dtype)

    @property
    def num_parameters(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        kv = self.num_key_value_heads * self.head_dim
        if self.is_encoder_decoder:  # biases, LayerNorms, learned positions; tied embeddings
            attn, ffn = 4 * h * h + 4 * h, 2 * h * i + i + h
            enc, dec = attn + ffn + 4 * h, 2 * attn + ffn + 6 * h
            positions = 2 * (self.max_position_embeddings + 2) * h
            return v * h + v + positions + 4 * h + self.encoder_layers * enc + self.num_hidden_layers * dec
        mlp = self.num_local_experts * 3 * h * i + h * self.num_local_experts if self.is_moe else 3 * h * i
        per_layer = h * h * 2 + h * kv * 2 + mlp + 2 * h
        return v * h * (1 if self.tie_word_embeddings else 2) + self.num_hidden_layers * per_layer + h

    @property
    def kv_bytes_per_token(self) -> int:
        """Keys and values of one token in every layer."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    def with_dtype(self, dtype: str) -> ModelConfig:
        return replace(self, dtype=dtype)

    def to_dict(self) -> dict:
        return asdict(self)


PRESETS: dict[str, ModelConfig] = {
    # Fast enough for the test suite: every strategy runs a few hundred requests in seconds.
    "tiny": ModelConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, intermediate_size=128, max_position_embeddings=1024),
    # For benchmarks: large enough that the device step dominates a host step on CPU.
    "small": ModelConfig(vocab_size=4096, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=2, intermediate_size=688, max_position_embeddings=2048),
    # An encoder–decoder (BART-shaped) for the encoder buffers and cross-attention KV.
    # A Mixtral-shaped decoder: 4 experts of which each token takes 2 (the mixture of experts' code paths).
    "tiny-moe": ModelConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, intermediate_size=96, max_position_embeddings=1024,
                            num_local_experts=4, num_experts_per_tok=2),
    "tiny-bart": ModelConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=4, intermediate_size=128, max_position_embeddings=1024,
                             architecture="bart", encoder_layers=2, tie_word_embeddings=True),
}
