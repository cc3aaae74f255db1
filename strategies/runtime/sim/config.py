"""The simulated device's settings, frozen and validated once, and the serving path it sits behind: what a
streaming HTTP client's TTFT and E2E include beyond the engine's own steps.

A real engine is measured through its API server. vLLM's (``vllm serve``, OpenAI-compatible, streaming):
the server parses the request and tokenises the prompt, hands it to the engine-core process (ZeroMQ,
msgpack); the engine core returns each step's outputs the same way; the server's output handler
detokenises every request's new tokens of the step and each request's stream writes its server-sent event.
Two parts, both on the client's clock only (the engine's scheduling is unchanged by them):
- ``fixed_s`` per request: the legs in and out (parse, tokenise, two process hops, the client's own
  reading) — a constant shift of every token a request receives;
- ``per_row_s`` per output row of the step: the output handler processes the whole step's outputs, and
  the event loop writes the other streams' events, before a given stream's event leaves.
The front end is one process that takes the steps' outputs in order (``VirtualClock.client_time``): it starts on a
step once the step's outputs exist and it is done with the previous step's, so a client never receives a step
before the one before it, and a front end that cannot keep up delays every later step (a queue, not a shift).

Both were fitted to one measured run (../shared/validation's llama-2-7b-tp1-general, its two stages: the
TTFT left after the engine loop — overlap's, vLLM's async scheduling — at 15.8 and 82.7 output rows a
step) and checked on the other runs (docs/simulator.md has the figures): 6.2 ms and 43 us a row. They
are properties of vLLM's front end on that host, not of the GPU. ``none``: the engine's own times, as
slotbench's CPU and CUDA devices record them (no HTTP). ``auto`` (the default): ``vllm`` where the simulated
device is a GPU, ``none`` where it is a CPU (a profile calibrated to a slotbench CPU run predicts that run,
which has no serving path).
"""

from __future__ import annotations

from dataclasses import dataclass

HOST_TIME = ("measured", "modelled")


@dataclass(frozen=True)
class ServingPath:
    fixed_s: float  # per request: the legs in and out
    per_row_s: float  # per output row of the step: the output handler's and the other streams' work first

    def delay_s(self, rows: int) -> float:
        return self.fixed_s + self.per_row_s * rows


SERVING_PATHS = {"vllm": ServingPath(6.2e-3, 43e-6), "none": ServingPath(0.0, 0.0)}
SERVING_CHOICES = ("auto", *SERVING_PATHS)


def serving_path(name: str, gpu: str) -> ServingPath:
    """The path ``name`` names; ``auto``: vLLM's in front of a GPU, none in front of a CPU."""
    return SERVING_PATHS[("none" if gpu == "cpu" else "vllm") if name == "auto" else name]


@dataclass(frozen=True)
class SimConfig:
    """The simulated device (``device="sim"``): what is modelled, on what, and how host time counts."""

    gpu: str = "h200"  # a datasheet (a100, a40, h100, h200, l40s, cpu); ignored when profile is given
    model_spec: str = "llama-3-8b"  # whose shapes the cost model uses (a spec preset or config.json dir)
    tp: int = 1  # tensor-parallel degree
    ep: int = 1  # expert-parallel degree (a mixture of experts): 1, or --tp (the experts split over those GPUs)
    moe_skew: float = 0.0  # a mixture of experts' routing: expert e's share of tokens ∝ (e + 1) ** -moe_skew
    profile: str | None = None  # a calibrated device profile (JSON from `slotbench calibrate`)
    dtype: str | None = None  # weights' and KV's dtype; None: the spec's own (config.json's torch_dtype)
    host_time: str = "measured"  # measured: real host code on the clock; modelled: the costs below
    host_ms_per_iteration: float = 0.0
    host_us_per_request: float = 0.0
    serving_path: str = "auto"  # what a streaming client's times include beyond the engine (SERVING_PATHS)

    def __post_init__(self) -> None:
        if self.tp <= 0:
            raise ValueError(f"--tp must be positive, got {self.tp}")
        if self.ep <= 0:
            raise ValueError(f"--ep must be positive, got {self.ep}")
        if not self.moe_skew >= 0:
            raise ValueError(f"--moe-skew must be >= 0, got {self.moe_skew}")
        if self.host_time not in HOST_TIME:
            raise ValueError(f"--host-time {self.host_time!r}: expected one of {', '.join(HOST_TIME)}")
        if self.serving_path not in SERVING_CHOICES:
            raise ValueError(f"--serving-path {self.serving_path!r}: expected one of {', '.join(SERVING_CHOICES)}")
        if self.host_ms_per_iteration < 0 or self.host_us_per_request < 0:
            raise ValueError("modelled host costs must be >= 0")
