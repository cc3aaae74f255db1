"""Model shapes and GPU datasheet figures for the simulated device."""

from __future__ import annotations

from dataclasses import dataclass

from strategies.runtime.models.checkpoint import resolve_model_config
from strategies.runtime.models.config import PRESETS, ModelConfig

# Shapes as published in each model's Hugging Face config.json (bf16 weights).
MODEL_SPECS: dict[str, ModelConfig] = {
    # meta-llama/Llama-2-7b-hf (float16): the model of the measured vLLM runs in ../shared/validation
    "llama-2-7b": ModelConfig(vocab_size=32000, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                              num_key_value_heads=32, intermediate_size=11008, max_position_embeddings=4096,
                              eos_token_id=2, dtype="float16"),
    # codellama/CodeLlama-34b-Instruct-hf (bfloat16): the model of the tensor-parallel (TP 2) measured vLLM runs
    "codellama-34b": ModelConfig(vocab_size=32000, hidden_size=8192, num_hidden_layers=48, num_attention_heads=64,
                                 num_key_value_heads=8, intermediate_size=22016, rope_theta=1000000.0,
                                 max_position_embeddings=16384, eos_token_id=2, dtype="bfloat16"),
    "llama-3-8b": ModelConfig(vocab_size=128256, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                              num_key_value_heads=8, intermediate_size=14336, rope_theta=500000.0,
                              max_position_embeddings=8192, eos_token_id=128001, dtype="bfloat16"),
    "llama-3-70b": ModelConfig(vocab_size=128256, hidden_size=8192, num_hidden_layers=80, num_attention_heads=64,
                               num_key_value_heads=8, intermediate_size=28672, rope_theta=500000.0,
                               max_position_embeddings=8192, eos_token_id=128001, dtype="bfloat16"),
    # meta-llama/Llama-3.2-1B: Llama 3's tokenizer, the usual draft model for Llama-3-8B and 70B
    "llama-3.2-1b": ModelConfig(vocab_size=128256, hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                                num_key_value_heads=8, intermediate_size=8192, rope_theta=500000.0,
                                max_position_embeddings=131072, eos_token_id=128001, dtype="bfloat16",
                                tie_word_embeddings=True),
    "qwen2.5-7b": ModelConfig(vocab_size=152064, hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                              num_key_value_heads=4, intermediate_size=18944, rope_theta=1000000.0,
                              max_position_embeddings=32768, eos_token_id=151645, dtype="bfloat16"),
    # mistralai/Mixtral-8x7B-v0.1: 8 experts a layer, 2 per token
    "mixtral-8x7b": ModelConfig(vocab_size=32000, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                                num_key_value_heads=8, intermediate_size=14336, rope_theta=1000000.0,
                                max_position_embeddings=32768, eos_token_id=2, dtype="bfloat16",
                                num_local_experts=8, num_experts_per_tok=2),
    # facebook/bart-large (an encoder–decoder; weights published in float32)
    "bart-large": ModelConfig(vocab_size=50265, hidden_size=1024, num_hidden_layers=12, num_attention_heads=16,
                              num_key_value_heads=16, intermediate_size=4096, max_position_embeddings=1024,
                              eos_token_id=2, dtype="float32", architecture="bart", encoder_layers=12,
                              tie_word_embeddings=True),
}


def resolve_model_spec(name_or_path: str) -> ModelConfig:
    """A spec preset, a slotbench preset (tiny, small), or a directory with a Hugging Face config.json."""
    if name_or_path in MODEL_SPECS:
        return MODEL_SPECS[name_or_path]
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    try:
        return resolve_model_config(name_or_path)
    except ValueError:
        raise ValueError(f"--model-spec {name_or_path!r}: expected one of "
                         f"{', '.join([*MODEL_SPECS, *PRESETS])} or a directory with config.json") from None


@dataclass(frozen=True)
class GpuSpec:
    name: str
    peak_flops: float  # dense bf16 FLOP/s (for "cpu": a nominal figure that calibration scales)
    mem_bw: float  # bytes/s
    mem_bytes: float  # device memory
    link_bw: float  # bytes/s per direction between GPUs (NVLink; PCIe for L40S)
    # streaming multiprocessors: attention runs thread blocks on them in rounds (0: priced as a plain
    # roofline, as on a CPU)
    sms: int = 0
    l2_bytes: float = 0.0  # last-level cache: element-wise kernels slow down past it (0: no such effect)
    # bytes/s per direction between the GPU and host memory: its PCIe link (generation and width, the datasheet's)
    host_link_bw: float = float("inf")


# PCIe per direction, x16: 16 lanes x the generation's transfer rate x 128b/130b encoding / 8 bits
PCIE4_X16 = 16 * 16e9 * 128 / 130 / 8  # 31.5 GB/s
PCIE5_X16 = 16 * 32e9 * 128 / 130 / 8  # 63.0 GB/s
# Of that, what pinned host<->device copies achieve: NVIDIA's nvbandwidth, host_to_device_memcpy_ce, 55.63 GB/s on
# a PCIe Gen5 x16 GPU (its published example output; docs/simulator.md, "Host KV tier")
HOST_LINK_EFFICIENCY = 55.63e9 / PCIE5_X16


GPUS: dict[str, GpuSpec] = {
    "a100": GpuSpec("a100", 312e12, 2.039e12, 80e9, 300e9, 108, 40e6, PCIE4_X16),
    # PCIe 4.0 between GPUs (NVLink pairs aside)
    "a40": GpuSpec("a40", 149.7e12, 696e9, 48e9, 32e9, 84, 6e6, PCIE4_X16),
    "h100": GpuSpec("h100", 989e12, 3.35e12, 80e9, 450e9, 132, 50e6, PCIE5_X16),  # SXM5: PCIe Gen5 x16 to the host
    "h200": GpuSpec("h200", 989e12, 4.8e12, 141e9, 450e9, 132, 50e6, PCIE5_X16),
    "l40s": GpuSpec("l40s", 362e12, 0.864e12, 48e9, 32e9, 142, 96e6, PCIE4_X16),
    # This machine's CPU as a "device": nominal figures; `slotbench calibrate` fits the efficiencies.
    "cpu": GpuSpec("cpu", 100e9, 20e9, 24e9, float("inf")),
}
