"""Load a local Hugging Face Llama checkpoint (``config.json`` + ``*.safetensors``). Never pickle."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from strategies.runtime.model import LlamaModel
from strategies.runtime.model_config import PRESETS, ModelConfig

_DTYPES = ("float32", "float64", "bfloat16", "float16")
_SUPPORTED_ARCHS = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"}


def config_from_hf(hf: dict, source: str = "config.json", dtype: str | None = None) -> ModelConfig:
    """Map a Hugging Face LlamaConfig dict to ModelConfig, refusing what the model cannot represent. The
    dtype is the checkpoint's ``torch_dtype`` (``dtype`` in newer configs) unless one is given."""
    archs = set(hf.get("architectures") or ["LlamaForCausalLM"])
    if not archs & _SUPPORTED_ARCHS:
        raise ValueError(f"{source}: architecture {sorted(archs)} is not Llama-style "
                         f"(supported: {', '.join(sorted(_SUPPORTED_ARCHS))})")
    if hf.get("rope_scaling"):
        raise ValueError(f"{source}: rope_scaling {hf['rope_scaling']!r} is not supported")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ValueError(f"{source}: attention/MLP biases are not supported")
    eos = hf.get("eos_token_id", 2)
    if isinstance(eos, list):
        eos = eos[0]
    heads = hf["num_attention_heads"]
    if dtype is None:
        dtype = str(hf.get("torch_dtype") or hf.get("dtype") or "float32").removeprefix("torch.")
        if dtype not in _DTYPES:
            raise ValueError(f"{source}: torch_dtype {dtype!r} is not one of {', '.join(_DTYPES)}")
    return ModelConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        num_hidden_layers=hf["num_hidden_layers"], num_attention_heads=heads,
        num_key_value_heads=hf.get("num_key_value_heads") or heads,
        intermediate_size=hf["intermediate_size"], rope_theta=float(hf.get("rope_theta", 10000.0)),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        eos_token_id=int(eos if eos is not None else 0), dtype=dtype,
    )


def resolve_model_config(name_or_path: str) -> ModelConfig:
    """A preset name, or a Hugging Face checkpoint directory (its ``config.json``)."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    path = Path(name_or_path)
    if not (path / "config.json").is_file():
        raise ValueError(f"--model {name_or_path!r}: not a preset ({', '.join(PRESETS)}) "
                         "and not a checkpoint directory with config.json")
    return config_from_hf(json.loads((path / "config.json").read_text()), source=str(path))


def load_checkpoint(path: str | Path, cfg: ModelConfig, device: torch.device | str = "cpu") -> LlamaModel:
    """Weights from every ``*.safetensors`` file in ``path``; names as Hugging Face saves them."""
    path = Path(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors files (pickle checkpoints are refused)")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    state = {k.removeprefix("model."): v for k, v in state.items()}
    if "lm_head.weight" not in state:
        if not cfg.tie_word_embeddings:
            raise ValueError(f"{path}: lm_head.weight missing and tie_word_embeddings is false")
        state["lm_head.weight"] = state["embed_tokens.weight"]
    model = LlamaModel(cfg)
    missing, unexpected = model.load_state_dict(state, strict=False)
    unexpected = [k for k in unexpected if not k.endswith("rotary_emb.inv_freq")]
    if missing or unexpected:
        raise ValueError(f"{path}: checkpoint does not match the config "
                         f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    return model.to(device=device, dtype=cfg.torch_dtype).eval().requires_grad_(False)


def read_hf_config(path: str | Path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())
