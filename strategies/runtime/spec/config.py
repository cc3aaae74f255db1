"""``--speculative-config``: vLLM's keys, validated once."""

from __future__ import annotations

import json
from dataclasses import dataclass

METHODS = ("ngram",)
KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")


@dataclass(frozen=True)
class SpecConfig:
    method: str = "ngram"  # ngram: prompt lookup (vLLM's NgramProposer, HF's prompt_lookup_num_tokens)
    num_speculative_tokens: int = 3  # K: draft tokens a generating row verifies per step, at most
    prompt_lookup_min: int = 1  # shortest suffix n-gram looked up in the request's tokens
    prompt_lookup_max: int = 3  # longest

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"--speculative-config method {self.method!r}: expected one of {', '.join(METHODS)} "
                             "(a draft model is not built yet)")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"--speculative-config num_speculative_tokens must be in [1, 16], "
                             f"got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"--speculative-config needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")


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
    for key in KEYS[1:]:
        if key in obj and not (isinstance(obj[key], int) and not isinstance(obj[key], bool)):
            raise ValueError(f"--speculative-config {key} must be an integer, got {obj[key]!r}")
    if "method" not in obj:
        raise ValueError("--speculative-config needs a method (ngram)")
    return SpecConfig(**obj)
