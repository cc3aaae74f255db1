"""The options of a run's client: its time-out, and a run against an OpenAI-compatible server (``--endpoint``):
slotbench's trace and records, the requests sent over HTTP instead of to a strategy (``harness/endpoint/``)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from harness.errors import UserError
from harness.options.field import opt

ENDPOINT = "endpoint"  # the strategy name of a run against a server (its directory, its summary row)
ENDPOINT_TYPES = ("completions", "chat")


@dataclass(frozen=True)
class EndpointOptions:
    endpoint: str | None = opt(None, "send every request to an OpenAI-compatible server at this base URL "
                                     "(http://host:port/v1) instead of running --strategies: vLLM, SGLang, "
                                     "trtllm-serve, `transformers serve`, `slotbench serve`")
    endpoint_type: str = opt("completions", "--endpoint: /completions (a prompt) or /chat/completions (the prompt "
                                            "as one user message)", choices=ENDPOINT_TYPES)
    served_model: str | None = opt(None, "--endpoint: the model name sent (default: the server's first, from "
                                         "/v1/models)")
    api_key_env: str | None = opt(None, "--endpoint: the environment variable holding a bearer token")
    tokenizer: str | None = opt(None, "a directory with tokenizer.json. --endpoint: prompts sent as its text "
                                      "(default: as token ids), outputs counted by it where the server gives no "
                                      "usage; serve: text in and out (default: the checkpoint's, or bytes for a "
                                      "preset); --workload-config: the server's, so that shared-prefix and random "
                                      "prompts are the generator's text as the server tokenised it (default: its "
                                      "random ids)")
    scrape_interval: float | None = opt(None, "--endpoint: read the server's /metrics every S seconds into "
                                              "<label>/server_metrics.parquet")
    request_timeout: float | None = opt(None, "seconds a client waits for a request's whole response before it gives "
                                              "up: the request fails and the engine aborts it; as aiohttp (inference-"
                                              "perf's client), 5 s or more end on a whole second (default: none; with "
                                              "--workload-config, the load generator's: inference-perf's "
                                              "load.request_timeout, or aiohttp's 300 s where it is null)")

    def check_endpoint(self) -> None:
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise UserError(f"--request-timeout must be positive, got {self.request_timeout}")
        if self.tokenizer is not None and not os.path.isfile(os.path.join(self.tokenizer, "tokenizer.json")):
            raise UserError(f"--tokenizer {self.tokenizer}: no tokenizer.json there")
        if self.endpoint is None:
            for name in ("served_model", "api_key_env", "scrape_interval"):
                if getattr(self, name) is not None:
                    raise UserError(f"--{name.replace('_', '-')} applies to --endpoint runs only")
            return
        if self.request_timeout is not None:  # (a workload config's time-out is not kept there either)
            raise UserError("--request-timeout: an --endpoint run's client keeps no time-out of its own yet")
        if not self.endpoint.startswith(("http://", "https://")):
            raise UserError(f"--endpoint {self.endpoint!r}: expected an http(s):// base URL, e.g. http://host:8000/v1")
        if self.api_key_env is not None and self.api_key_env not in os.environ:
            raise UserError(f"--api-key-env {self.api_key_env}: no such environment variable")
        if self.scrape_interval is not None and not self.scrape_interval > 0:
            raise UserError(f"--scrape-interval must be positive, got {self.scrape_interval}")
