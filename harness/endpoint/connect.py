"""Before an endpoint run: the server reached (``GET /v1/models``), the model it serves named with the context it
states, the tokenizer loaded — or one line and exit 2, before anything is measured or written."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request

from harness.endpoint.client import EndpointSettings
from harness.errors import UserError
from harness.options import RunOptions
from harness.serve.tokenizer import CheckpointTokenizer


def connect(opts: RunOptions) -> EndpointSettings:
    assert opts.endpoint is not None
    url = opts.endpoint.rstrip("/")
    key = os.environ[opts.api_key_env] if opts.api_key_env else None
    request = urllib.request.Request(f"{url}/models", headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            listed = [m for m in json.loads(resp.read()).get("data", []) if isinstance(m, dict) and "id" in m]
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise UserError(f"--endpoint {opts.endpoint}: the server does not answer ({reason})") from None
    if opts.served_model is None and not listed:
        raise UserError(f"--endpoint {opts.endpoint}: the server lists no model; name one with --served-model")
    tokenizer = CheckpointTokenizer(opts.tokenizer) if opts.tokenizer else None
    if opts.endpoint_type == "chat" and tokenizer is None:
        raise UserError("--endpoint-type chat sends text: give --tokenizer DIR (the server's tokenizer)")
    model = opts.served_model or listed[0]["id"]
    # vLLM (and slotbench serve) state the model's context: the trace's requests are sized by it, not by --model's
    stated = [m.get("max_model_len") for m in listed if m["id"] == model]
    context = stated[0] if stated and isinstance(stated[0], int) and stated[0] > 0 else None
    return EndpointSettings(url, opts.endpoint_type, model, key, tokenizer, opts.scrape_interval, opts.max_concurrency,
                            _takes_token_ids(url, opts.endpoint_type, model, key), context)


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
