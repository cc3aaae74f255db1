"""The OpenAI-compatible front end of ``slotbench serve`` (aiohttp): ``POST /v1/completions`` and
``/v1/chat/completions`` (streamed as server-sent events or not), ``GET /v1/models``, ``/health``, ``/metrics``.

Each request becomes one ``Request`` of the served engine, which runs in a process of its own
(``engine_process.py``); the front end keeps a copy of each, which the engine client (``engine_client.py``) brings
up to date as the engine publishes its steps, then calls ``notify``: the front end hands each stream the tokens its
request received since (the tokens a step handed out together are one event, as vLLM streams them) and its end.
A client that goes away has its request aborted (slot and blocks given back). A request the engine can never serve
(its ``rejection``) is a 400. Errors use vLLM's shape and status: ``{"error": {"message", "type", "param",
"code"}}`` — 400 for a malformed body, a prompt over the context or ``max_tokens`` < 1; 404 for an unknown model
(vLLM's NotFoundError); 503 while shutting down or after an engine fault.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
from dataclasses import dataclass, field

import numpy as np
from aiohttp import web

from harness.serve.engine_client import EngineClient
from harness.serve.engine_process import SHUTTING_DOWN
from harness.serve.metrics import ServerMetrics
from harness.serve.tokenizer import IncrementalText, Tokenizer
from strategies.runtime.request import Request, Status
from strategies.runtime.sampling_params import SamplingParams


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400, kind: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status, self.kind = status, kind


def error(message: str, status: int, kind: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "param": None, "code": status}},
                             status=status)


@dataclass
class _Track:
    """A request between the engine's thread and its handler."""

    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    sent: int = 0  # tokens handed to the handler so far
    last_s: float | None = None  # the time of the last token handed over (the next gap starts there)


class FrontEnd:
    def __init__(self, engine: EngineClient, tokenizer: Tokenizer | None, model_names: list[str]) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_names[0]  # a response's ``model``; a request may name any of them (vLLM's)
        self.model_names = list(dict.fromkeys(model_names))
        self.metrics = ServerMetrics(self.model_name, host_tier=bool(engine.executor.kv_offload_blocks))
        self.loop: asyncio.AbstractEventLoop | None = None
        self.closing = False
        self._lock = threading.Lock()
        self._active: dict[Request, _Track] = {}
        self.proxied = engine.name == "disagg"  # the ttft a client behind a proxy sees (docs/outputs.md, "Metrics")
        self._ids = itertools.count()

    def app(self) -> web.Application:
        app = web.Application()
        app.add_routes([web.post("/v1/completions", self.completions), web.post("/v1/chat/completions", self.chat),
                        web.get("/v1/models", self.models), web.get("/health", self.health),
                        web.get("/metrics", self.prometheus)])
        return app

    # --- the engine client's thread --------------------------------------------------------------
    def replied(self, r: Request, reason: str | None, status: int) -> None:
        """The engine took ``r`` (``reason`` None) or refused it (why, and the status to answer): to its handler,
        before any of its tokens."""
        with self._lock:
            tr = self._active.get(r)
        if tr is not None and self.loop is not None:
            self.loop.call_soon_threadsafe(tr.queue.put_nowait, ("reply", (reason, status)))

    def notify(self) -> None:
        """New tokens and ends, to each request's handler (called as the engine publishes a step)."""
        self.metrics.engine_state(*self.engine.state)
        with self._lock:
            items = list(self._active.items())
        loop = self.loop
        for r, tr in items:
            n = r.num_output_tokens
            if n == 1 and self.proxied and not r.status.terminal:
                continue  # disagg: as vLLM's proxy, the first token goes out with the decode worker's first
            if n > tr.sent:
                tokens = r.output_tokens[tr.sent:n].tolist()
                times = r.token_times_since(tr.sent)[: n - tr.sent]
                self.metrics.tokens(r, tr.sent == 0, times, tr.last_s)
                tr.sent, tr.last_s = n, times[-1]
                if loop is not None:
                    loop.call_soon_threadsafe(tr.queue.put_nowait, ("tokens", tokens))
            if r.status.terminal:
                with self._lock:
                    self._active.pop(r, None)
                self.metrics.ended(r)
                if loop is not None:
                    loop.call_soon_threadsafe(tr.queue.put_nowait, ("end", None))

    # --- handlers ---------------------------------------------------------------------------------
    async def models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": name, "object": "model", "owned_by": "slotbench", "created": 0,
             "max_model_len": self.engine.opts.max_seq_len} for name in self.model_names]})

    async def health(self, _: web.Request) -> web.Response:
        ok = self.engine.alive and not self.closing
        return web.Response(status=200 if ok else 503)

    async def prometheus(self, _: web.Request) -> web.Response:
        return web.Response(text=self.metrics.text(), content_type="text/plain", charset="utf-8")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        if self.closing or not self.engine.alive:
            return error("the server is shutting down" if self.closing else f"engine stopped: {self.engine.error}",
                         503, "ServiceUnavailableError")
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise BadRequest("the body must be a JSON object")
            r, opts = self._request(body, chat)
        except json.JSONDecodeError as exc:
            return error(f"malformed JSON body: {exc}", 400, "BadRequestError")
        except BadRequest as exc:
            return error(str(exc), exc.status, exc.kind)
        tr = _Track()
        with self._lock:
            self._active[r] = tr
        self.engine.submit(r)
        taken, kind = False, None
        try:
            kind, answer = await tr.queue.get()  # the engine's answer comes before any token
            reason, status = answer if kind == "reply" else (self.engine.error or SHUTTING_DOWN, 503)
            if reason is not None:  # it can never be served here (400), or the engine stopped taking requests
                with self._lock:
                    self._active.pop(r, None)
                return error(reason, status, "BadRequestError" if status == 400 else "ServiceUnavailableError")
            taken = True
            if opts["stream"]:
                return await self._stream(request, r, tr, chat, opts)
            return await self._whole(r, tr, chat, opts)
        finally:  # the client went away (a cancelled handler, a failed write): the request ends here too
            if not r.status.terminal and (taken or kind is None):
                self.engine.abort(r, "aborted: the client disconnected")

    def _request(self, body: dict, chat: bool) -> tuple[Request, dict]:
        model = body.get("model", self.model_name)
        if model not in self.model_names:
            raise BadRequest(f"The model `{model}` does not exist.", 404, "NotFoundError")
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise BadRequest("'messages' must be a non-empty list")
            try:
                text = self._tokenizer().chat(messages)
            except Exception as exc:  # (jinja2's TemplateError, SecurityError: the template refused these messages)
                raise BadRequest(f"the chat template: {type(exc).__name__}: {exc}") from None
            ids = self._encode(text, add_special_tokens=False)  # (the template writes its own specials)
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]  # a batch of one
            if isinstance(prompt, str):
                ids = self._encode(prompt, add_special_tokens=True)  # BOS as the tokenizer says, as vLLM's
            elif isinstance(prompt, list) and prompt and all(isinstance(x, int) and not isinstance(x, bool)
                                                             for x in prompt):
                ids = prompt
            else:
                raise BadRequest("'prompt' must be a string or a list of token ids (one prompt per request)")
        max_seq = self.engine.opts.max_seq_len
        default_max = 16 if not chat else max_seq - len(ids)
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens")) if chat else body.get("max_tokens")
        max_tokens = default_max if max_tokens is None else max_tokens
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise BadRequest(f"max_tokens must be at least 1, got {max_tokens!r}")
        if len(ids) + max_tokens > max_seq:
            raise BadRequest(f"This model's maximum context length is {max_seq} tokens. However, you requested "
                             f"{len(ids) + max_tokens} tokens ({len(ids)} in the messages, {max_tokens} in the "
                             "completion). Please reduce the length of the messages or completion.")
        n = next(self._ids)
        try:
            sampling = SamplingParams(
                temperature=float(body.get("temperature", 1.0)), top_p=float(body.get("top_p", 1.0)),
                top_k=max(0, int(body.get("top_k") or 0)), min_p=float(body.get("min_p", 0.0)),
                seed=int(body["seed"]) if body.get("seed") is not None else n,
                stop_token_ids=tuple(int(x) for x in body.get("stop_token_ids") or ()),
                ignore_eos=bool(body.get("ignore_eos", False)))
        except (TypeError, ValueError) as exc:
            raise BadRequest(f"sampling parameters: {exc}") from None
        r = Request(f"{'chatcmpl' if chat else 'cmpl'}-{n}", np.asarray(ids, dtype=np.int64), max_tokens, sampling)
        usage = bool((body.get("stream_options") or {}).get("include_usage", False))
        return r, {"stream": bool(body.get("stream", False)), "usage": usage,
                   "skip_special_tokens": bool(body.get("skip_special_tokens", True)),
                   "token_ids": bool(body.get("return_token_ids", False)), "created": int(time.time())}

    def _tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise BadRequest("this model has no tokenizer: send the prompt as token ids")
        return self.tokenizer

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        ids = self._tokenizer().encode(text, add_special_tokens)
        if not ids:
            raise BadRequest("the prompt is empty")
        return ids

    def _text(self, tokens: list[int], skip_special_tokens: bool) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens) if self.tokenizer is not None else ""

    async def _events(self, tr: _Track):
        while True:
            kind, payload = await tr.queue.get()
            if kind == "end":
                return
            yield payload

    async def _stream(self, request: web.Request, r: Request, tr: _Track, chat: bool, opts: dict) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        text = IncrementalText(self.tokenizer, opts["skip_special_tokens"]) if self.tokenizer is not None else None
        async for new in self._events(tr):
            delta = text.add(new) if text is not None else ""
            await resp.write(self._sse(self._chunk(r, chat, opts, delta, new, None)))
        tail = text.flush() if text is not None else ""
        await resp.write(self._sse(self._chunk(r, chat, opts, tail, [], self._finish(r))))
        if opts["usage"]:
            await resp.write(self._sse({**self._head(r, chat, opts, chunk=True), "choices": [],
                                        "usage": self._usage(r)}))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _whole(self, r: Request, tr: _Track, chat: bool, opts: dict) -> web.Response:
        tokens: list[int] = []
        async for new in self._events(tr):
            tokens += new
        if r.status is Status.FAILED and not tokens:
            return error(f"the request failed: {r.finish_reason}", 503 if self.closing else 500,
                         "InternalServerError")
        text = self._text(tokens, opts["skip_special_tokens"])
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}} if chat
                  else {"index": 0, "text": text, "logprobs": None})
        choice["finish_reason"] = self._finish(r)
        if opts["token_ids"]:
            choice["token_ids"] = tokens
        return web.json_response({**self._head(r, chat, opts, chunk=False), "choices": [choice],
                                  "usage": self._usage(r)})

    def _head(self, r: Request, chat: bool, opts: dict, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion"
        return {"id": r.request_id, "object": kind, "created": opts["created"], "model": self.model_name}

    def _chunk(self, r: Request, chat: bool, opts: dict, delta: str, tokens: list[int], finish: str | None) -> dict:
        if chat:
            choice = {"index": 0, "delta": {"role": "assistant", "content": delta} if delta or finish is None
                      else {}, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish}
        if opts["token_ids"]:
            choice["token_ids"] = tokens
        return {**self._head(r, chat, opts, chunk=True), "choices": [choice]}

    @staticmethod
    def _sse(data: dict) -> bytes:
        return f"data: {json.dumps(data)}\n\n".encode()

    @staticmethod
    def _finish(r: Request) -> str:
        return r.finish_reason if r.status is Status.FINISHED and r.finish_reason in ("stop", "length") else "abort"

    @staticmethod
    def _usage(r: Request) -> dict:
        n = r.num_output_tokens
        return {"prompt_tokens": r.prompt_len, "completion_tokens": n, "total_tokens": r.prompt_len + n}
