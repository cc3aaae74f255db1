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
    return client_for(EndpointSettings(url, opts.endpoint_type, opts.served_model or models[0], key, tokenizer,
                                       opts.scrape_interval, opts.max_concurrency))
