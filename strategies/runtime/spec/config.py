"""``--speculative-config``: vLLM's keys, validated once."""

from __future__ import annotations

import json
from dataclasses import dataclass

METHODS = ("ngram", "draft_model")
KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "acceptance_rate", "model")


@dataclass(frozen=True)
class SpecConfig:
    # ngram: prompt lookup (vLLM's NgramProposer, HF's prompt_lookup_num_tokens); draft_model: a smaller model
    # drafts K tokens autoregressively (HF's assistant_model) — priced on the simulated device only, for now
    method: str = "ngram"
    num_speculative_tokens: int = 3  # K: draft tokens a generating row verifies per step, at most
    prompt_lookup_min: int = 1  # shortest suffix n-gram looked up in the request's tokens
    prompt_lookup_max: int = 3  # longest
    # The simulated device only (slotbench's key, after TensorRT-LLM's testing knob): every generating row
    # proposes K drafts and each is accepted with this probability while the ones before it were, so
    # throughput can be studied against batch size and acceptance without a real proposer.
    acceptance_rate: float | None = None
    model: str | None = None  # draft_model: the draft's shapes (a spec preset, llama-3.2-1b, or a config.json dir)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"--speculative-config method {self.method!r}: expected one of {', '.join(METHODS)}")
        if (self.model is None) == (self.method == "draft_model"):
            raise ValueError("--speculative-config: method draft_model needs a model (the draft's spec), and only "
                             "it takes one")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"--speculative-config num_speculative_tokens must be in [1, 16], "
                             f"got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"--speculative-config needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if self.acceptance_rate is not None and not 0 <= self.acceptance_rate <= 1:
            raise ValueError(f"--speculative-config acceptance_rate must be in [0, 1], got {self.acceptance_rate}")


def parse_speculative_config(text: str) -> SpecConfig:
    """A JSON object of vLLM's keys (``{"method": "ngram", "num_speculative_tokens": 3, ...}``)."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--speculative-config is not JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise ValueError("--speculative-config must be a JSON object")
    unknown = set(obj) - set(KEYS)
    if unknown:
        raise ValueError(f"--speculative-config: unknown key(s) {', '.join(sorted(unknown))}; known: {', '.join(KEYS)}")
    rate = obj.get("acceptance_rate")
    if rate is not None and (not isinstance(rate, int | float) or isinstance(rate, bool)):
        raise ValueError(f"--speculative-config acceptance_rate must be a number, got {rate!r}")
    if "model" in obj and not isinstance(obj["model"], str):
        raise ValueError(f"--speculative-config model must be a string, got {obj['model']!r}")
    for key in KEYS[1:4]:
        if key in obj and not (isinstance(obj[key], int) and not isinstance(obj[key], bool)):
            raise ValueError(f"--speculative-config {key} must be an integer, got {obj[key]!r}")
    if "method" not in obj:
        raise ValueError("--speculative-config needs a method (ngram or draft_model)")
    return SpecConfig(**obj)
