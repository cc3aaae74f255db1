"""Load a local Hugging Face checkpoint (``config.json`` + ``*.safetensors``): Llama-style decoders, and
BART encoder–decoders. Never pickle. Reading a config imports no torch (the simulated device reads the
same configs, ``sim/specs.py``, and never imports it); loading weights does."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from strategies.runtime.models.config import DTYPE_BYTES, PRESETS, ModelConfig

if TYPE_CHECKING:
    import torch

_SUPPORTED_ARCHS = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "MixtralForCausalLM"}
_BART_ARCHS = {"BartForConditionalGeneration"}


def _dtype_of(hf: dict, source: str, dtype: str | None) -> str:
    if dtype is None:
        dtype = str(hf.get("torch_dtype") or hf.get("dtype") or "float32").removeprefix("torch.")
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"{source}: torch_dtype {dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
    return dtype


def _bart_config(hf: dict, source: str, dtype: str | None) -> ModelConfig:
    """BartConfig → ModelConfig; the encoder's sizes must equal the decoder's, and HF's generation extras
    slotbench does not apply (forced BOS/EOS, n-gram blocking) must be off."""
    for enc, dec in (("encoder_attention_heads", "decoder_attention_heads"), ("encoder_ffn_dim", "decoder_ffn_dim")):
        if hf.get(enc) != hf.get(dec):
            raise ValueError(f"{source}: {enc} ({hf.get(enc)}) differs from {dec} ({hf.get(dec)})")
    if hf.get("activation_function", "gelu") != "gelu" or hf.get("add_final_layer_norm") or hf.get("normalize_before"):
        raise ValueError(f"{source}: only BART's own layout is supported (gelu, post-LayerNorm)")
    for key in ("forced_eos_token_id", "forced_bos_token_id", "no_repeat_ngram_size"):
        if hf.get(key):
            raise ValueError(f"{source}: {key}={hf[key]!r} (a generation rule slotbench does not apply)")
    heads = hf["decoder_attention_heads"]
    return ModelConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["d_model"], num_hidden_layers=hf["decoder_layers"],
        num_attention_heads=heads, num_key_value_heads=heads, intermediate_size=hf["decoder_ffn_dim"],
        max_position_embeddings=hf.get("max_position_embeddings", 1024), tie_word_embeddings=True,
        eos_token_id=int(hf.get("eos_token_id", 2)), dtype=_dtype_of(hf, source, dtype), architecture="bart",
        encoder_layers=hf["encoder_layers"], decoder_start_token_id=int(hf.get("decoder_start_token_id", 2)),
        scale_embedding=bool(hf.get("scale_embedding", False)))


def config_from_hf(hf: dict, source: str = "config.json", dtype: str | None = None) -> ModelConfig:
    """Map a Hugging Face LlamaConfig dict to ModelConfig, refusing what the model cannot represent. The
    dtype is the checkpoint's ``torch_dtype`` (``dtype`` in newer configs) unless one is given."""
    archs = set(hf.get("architectures") or ["LlamaForCausalLM"])
    if archs & _BART_ARCHS or hf.get("model_type") == "bart":
        return _bart_config(hf, source, dtype)
    if not archs & _SUPPORTED_ARCHS:
        raise ValueError(f"{source}: architecture {sorted(archs)} is not Llama-style "
                         f"(supported: {', '.join(sorted(_SUPPORTED_ARCHS | _BART_ARCHS))})")
    rope = hf.get("rope_parameters") or {}  # transformers 5 keeps rope_theta there
    if hf.get("rope_scaling") or rope.get("rope_type", "default") != "default":
        raise ValueError(f"{source}: rope scaling {hf.get('rope_scaling') or rope!r} is not supported")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ValueError(f"{source}: attention/MLP biases are not supported")
    eos = hf.get("eos_token_id", 2)
    if isinstance(eos, list):
        eos = eos[0]
    heads = hf["num_attention_heads"]
    dtype = _dtype_of(hf, source, dtype)
    return ModelConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        num_hidden_layers=hf["num_hidden_layers"], num_attention_heads=heads,
        num_key_value_heads=hf.get("num_key_value_heads") or heads,
        intermediate_size=hf["intermediate_size"],
        rope_theta=float(hf.get("rope_theta") or rope.get("rope_theta") or 10000.0),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        eos_token_id=int(eos if eos is not None else 0), dtype=dtype,
        num_local_experts=int(hf.get("num_local_experts") or 0),
        num_experts_per_tok=int(hf.get("num_experts_per_tok") or 0),
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


def load_checkpoint(path: str | Path, cfg: ModelConfig, device: torch.device | str = "cpu") -> torch.nn.Module:
    """Weights from every ``*.safetensors`` file in ``path``; names as Hugging Face saves them."""
    from safetensors.torch import load_file

    from strategies.runtime.models.llama import LlamaModel

    path = Path(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors files (pickle checkpoints are refused)")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    # Mixtral's sparse MLP is the layer's ``mlp`` here (models/moe.py)
    state = {k.removeprefix("model.").replace(".block_sparse_moe.", ".mlp."): v for k, v in state.items()}
    if cfg.is_encoder_decoder:
        return _load_bart(path, cfg, state, device)
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


def _load_bart(path: Path, cfg: ModelConfig, state: dict[str, torch.Tensor],
               device: torch.device | str) -> torch.nn.Module:
    import torch

    from strategies.runtime.models.bart import BartModel

    for tied in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight"):
        state.pop(tied, None)  # all three are ``shared``
    state["lm_head.weight"] = state["shared.weight"]
    if "final_logits_bias" not in state:
        state["final_logits_bias"] = torch.zeros(1, cfg.vocab_size)
    model = BartModel(cfg)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{path}: checkpoint does not match the config "
                         f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    return model.to(device=device, dtype=cfg.torch_dtype).eval().requires_grad_(False)


def read_hf_config(path: str | Path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())
