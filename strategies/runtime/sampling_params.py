"""Per-request sampling and beam-search options, with Hugging Face's meanings."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. temperature 0 is greedy; top_k 0, top_p 1 and min_p 0 disable a filter."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()  # besides the model's EOS, unless ignore_eos
    ignore_eos: bool = False
    # Beam search (deterministic, Hugging Face's meanings): beams kept per request; the exponent of the
    # generated length that divides a finished beam's log-probability; when a request stops (True: as
    # soon as beam_width beams finished; False: once no running beam can beat the finished ones by HF's
    # heuristic; "never": the exact criterion); how many of the best finished beams are returned.
    beam_width: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    num_return_sequences: int = 1

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p}")
        if not 0 <= self.seed < 2**32:
            raise ValueError(f"seed must be in [0, 2**32), got {self.seed}")
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be >= 1, got {self.beam_width}")
        if not 1 <= self.num_return_sequences <= self.beam_width:
            raise ValueError(f"num_return_sequences must be in [1, beam_width={self.beam_width}], "
                             f"got {self.num_return_sequences}")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be true, false or 'never', got {self.early_stopping!r}")
        if self.beam_width > 1 and self.temperature > 0:
            raise ValueError("beam search is deterministic here: temperature must be 0 with beam_width > 1")

    @property
    def early_stopping_code(self) -> int:
        """The device's encoding of early_stopping: 0 False, 1 True, 2 "never"."""
        return 2 if self.early_stopping == "never" else int(bool(self.early_stopping))

    @property
    def uses_filters(self) -> bool:
        return self.temperature > 0 and (self.top_k > 0 or self.top_p < 1 or self.min_p > 0)
