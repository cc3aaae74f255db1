"""The endpoint client against a server that misbehaves (a fake one, in this process's thread): a malformed event
fails only its own request, with the reason, and keeps the tokens that came before it; the others finish; and a
request's output is the server's usage count where it gives one, re-counted tokens past it dropped."""

from __future__ import annotations

import asyncio
import itertools
import json
import socket
import threading

import pandas as pd
from aiohttp import web

from tests.util import cli

MALFORMED = [b"data: 7", b"data: [1]", b'data: {"choices": ["x"]}']


def _chunk(ids: list[int], finish: str | None = None, usage: int | None = None) -> bytes:
    obj = {"choices": [{"index": 0, "text": "", "token_ids": ids, "finish_reason": finish}]}
    if usage is not None:
        obj["usage"] = {"completion_tokens": usage}
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _fake_server() -> tuple[str, list[str], threading.Event]:
    """An OpenAI-style server whose every fourth request (from the second) streams two tokens, then a malformed
    event, then an orderly end; every fourth from the third streams five tokens and says it generated three."""
    seen = itertools.count()
    kinds: list[str] = []

    async def models(_):
        return web.json_response({"data": [{"id": "fake", "max_model_len": 256}]})

    async def completions(request):
        body = await request.json()
        if not body.get("stream"):  # the client's probe for return_token_ids
            return web.json_response({"choices": [{"index": 0, "text": "a", "token_ids": [1]}]})
        n, want = next(seen), body["max_tokens"]
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if n % 4 == 1:
            kinds.append("malformed")
            await resp.write(_chunk([7, 7]))
            await resp.write(MALFORMED[(n // 4) % 3] + b"\n\n")
            await resp.write(_chunk([7], "length", want))
        elif n % 4 == 2:
            kinds.append("over-counted")
            await resp.write(_chunk([9] * 5, "length", 3))
        else:
            kinds.append("ok")
            await resp.write(_chunk(list(range(1, want + 1)), "length", want))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ready, stop = threading.Event(), threading.Event()

    def serve() -> None:
        async def main() -> None:
            app = web.Application()
            app.router.add_get("/v1/models", models)
            app.router.add_post("/v1/completions", completions)
            runner = web.AppRunner(app)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            ready.set()
            while not stop.is_set():
                await asyncio.sleep(0.05)
            await runner.cleanup()

        asyncio.run(main())

    threading.Thread(target=serve, daemon=True).start()
    ready.wait(10)
    return f"http://127.0.0.1:{port}/v1", kinds, stop


def test_a_malformed_event_fails_its_request_only_and_usage_counts_the_output(tmp_path):
    url, kinds, stop = _fake_server()
    try:
        p = cli("run", "--endpoint", url, "--model", "tiny", "--num-prompts", "12", "--request-rate", "200",
                "--max-concurrency", "1", "--input-len", "8", "--output-len", "6", "--warmup", "0", "--no-progress",
                "--out", str(tmp_path / "r"))
    finally:
        stop.set()
    assert p.returncode == 0, p.stderr  # the server's faults are records, not the client's end
    req = pd.read_parquet(tmp_path / "r" / "endpoint" / "requests.parquet")
    tokens = {json.loads(x)["request_id"]: json.loads(x)["tokens"]
              for x in (tmp_path / "r" / "endpoint" / "tokens.jsonl").read_text().splitlines()}
    # one at a time (--max-concurrency 1): the server saw them in the client's order
    order = req.sort_values("arrival_s")["request_id"].tolist()
    assert len(kinds) == len(order) == 12
    for rid, kind in zip(order, kinds, strict=True):
        row = req.set_index("request_id").loc[rid]
        if kind == "malformed":
            assert row["status"] == "failed" and "malformed event" in row["finish_reason"], row["finish_reason"]
            assert tokens[rid] == [7, 7]  # what came before the bad event is kept, nothing after it
        elif kind == "over-counted":
            assert row["status"] == "finished" and tokens[rid] == [9, 9, 9]  # the server's count, not the ids'
        else:
            n = row["output_tokens"]  # the server's ids in order, as many as its usage says (its max_tokens)
            assert row["status"] == "finished" and n > 0 and tokens[rid] == list(range(1, n + 1))
    assert kinds.count("malformed") == 3 and kinds.count("over-counted") == 3


def test_a_prompt_sent_as_text_leaves_the_servers_bos_to_the_server(tmp_path):
    """A prompt's ids hold the BOS the server's tokenizer adds (a workload's prompts are the ids the server
    computed): sent as text, that BOS is left out, so that the server, encoding the text, gets the ids back — one
    BOS, not a literal '<s>' and another."""
    import numpy as np

    from harness.endpoint.client import EndpointClient, EndpointSettings
    from harness.serve.tokenizer import CheckpointTokenizer
    from strategies.runtime.request import Request
    from tests.util import char_tokenizer

    char_tokenizer("abcdef ", "<unk>").save_pretrained(tmp_path / "tok")  # its post-processor adds BOS, as Llama's
    tok = CheckpointTokenizer(tmp_path / "tok")
    ids = tok.encode("a bad face")
    assert ids[0] == 1 and tok.added_ids == [1]
    for kind in ("completions", "chat"):
        client = object.__new__(EndpointClient)
        client.settings = EndpointSettings("http://127.0.0.1:1/v1", kind, "m", None, tok, None, None)
        body = client._body(Request("r", np.asarray(ids), 4))
        text = body["prompt"] if kind == "completions" else body["messages"][0]["content"]
        assert text == "a bad face" and tok.encode(text) == ids
