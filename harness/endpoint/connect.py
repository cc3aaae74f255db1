"""Before an endpoint run: the server reached (``GET /v1/models``), the model it serves named, the tokenizer
loaded, and the client bound to them — or one line and exit 2, before anything is measured or written."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request

from harness.endpoint.client import EndpointClient, EndpointSettings, client_for
from harness.errors import UserError
from harness.options import RunOptions
from harness.serve.tokenizer import CheckpointTokenizer


def connect(opts: RunOptions) -> type[EndpointClient]:
    assert opts.endpoint is not None
    url = opts.endpoint.rstrip("/")
    key = os.environ[opts.api_key_env] if opts.api_key_env else None
    request = urllib.request.Request(f"{url}/models", headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            models = [m["id"] for m in json.loads(resp.read()).get("data", [])]
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise UserError(f"--endpoint {opts.endpoint}: the server does not answer ({reason})") from None
    if opts.served_model is None and not models:
        raise UserError(f"--endpoint {opts.endpoint}: the server lists no model; name one with --served-model")
    tokenizer = CheckpointTokenizer(opts.tokenizer) if opts.tokenizer else None
    if opts.endpoint_type == "chat" and tokenizer is None:
        raise UserError("--endpoint-type chat sends text: give --tokenizer DIR (the server's tokenizer)")
    model = opts.served_model or models[0]
    return client_for(EndpointSettings(url, opts.endpoint_type, model, key, tokenizer, opts.scrape_interval,
                                       opts.max_concurrency, _takes_token_ids(url, opts.endpoint_type, model, key)))


def _takes_token_ids(url: str, kind: str, model: str, key: str | None) -> bool:
    """Whether the server answers a one-token request that asks for its token ids (vLLM's ``return_token_ids``,
    slotbench serve's): then the client records the server's ids, else it re-tokenises the text."""
    body = {"model": model, "max_tokens": 1, "return_token_ids": True,
            **({"messages": [{"role": "user", "content": "a"}]} if kind == "chat" else {"prompt": "a"})}
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    path = "chat/completions" if kind == "chat" else "completions"
    request = urllib.request.Request(f"{url}/{path}", json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            choices = json.loads(resp.read()).get("choices") or [{}]
            return "token_ids" in choices[0]
    except (urllib.error.URLError, OSError, ValueError):
        return False
