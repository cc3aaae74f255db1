"""The client executor: each request of the trace sent to an OpenAI-compatible server when it arrives, streamed,
one time recorded per event (an event that carries several tokens is one chunk: one inter-token gap, as
``vllm bench serve`` counts it); the output tokens are the server's usage count, placed at the last event where
the events carried fewer ids. It is an ``Executor`` like the strategies, so the trace replay (rates, ramps,
sessions, ``--max-concurrency``), the records and the report are the same; it has no engine records.

The client must not be the bottleneck: one aiohttp session, its connection pool sized to the concurrency, and
each request's own processing (building the body, parsing events) timed into ``client_s`` — stated per request
at the end of a run.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import ClassVar

import aiohttp

from harness.endpoint.stream import Answer
from harness.options.endpoint import ENDPOINT
from harness.serve.tokenizer import Tokenizer
from strategies.interface import Executor, RequestSource
from strategies.runtime.request import Request, Status


@dataclass(frozen=True)
class EndpointSettings:
    url: str  # the base URL, ending in /v1
    kind: str  # completions | chat
    model: str  # the model name sent
    api_key: str | None
    tokenizer: Tokenizer | None  # prompts as its text (else token ids), outputs counted by it without usage
    scrape_s: float | None  # read /metrics this often (server_metrics.parquet)
    max_concurrency: int | None
    token_ids: bool = False  # the server takes vLLM's ``return_token_ids`` (probed by ``connect``)
    max_model_len: int | None = None  # the context the server states for the model (vLLM's /v1/models), if it does
    max_seq_len: int | None = None  # the context the trace's requests were sized by: a longer one has no prompt


class EndpointClient(Executor):
    name = ENDPOINT
    settings: ClassVar[EndpointSettings]  # bound per run: ``client_for``

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.server_metrics: list[dict] = []  # one row per scrape of the server's /metrics
        self.client_s: list[float] = []  # per request: the client's own processing (body, events), seconds

    def extras(self) -> dict:
        """The server's metrics over the run, and the client's own processing per request (µs, median)."""
        cost = sorted(self.client_s)
        return {"server_metrics": self.server_metrics,
                "client_us_per_request": cost[len(cost) // 2] * 1e6 if cost else None}

    def rejection(self, r: Request) -> str | None:
        """The server decides what it serves: a refusal comes back as an error and fails the request."""
        if r.prompt_len == 0:
            return "empty prompt"
        if not len(r.prompt_token_ids):  # a trace line longer than any context: sized, never built (runner.py)
            limit = self.settings.max_seq_len
            head = f"prompt ({r.prompt_len}) + max_tokens ({r.max_new_tokens}) exceeds"
            if limit == self.settings.max_model_len:
                return f"{head} the server's max_model_len ({limit})"
            return f"{head} --max-seq-len ({limit}; the server states no max_model_len, and its default is --model's)"
        return None if r.max_new_tokens > 0 else f"max_new_tokens must be positive, got {r.max_new_tokens}"

    def run(self, source: RequestSource) -> None:
        self.source = source
        asyncio.run(self._run(source))

    async def _run(self, source: RequestSource) -> None:
        s = self.settings
        connector = aiohttp.TCPConnector(limit=s.max_concurrency or 0, limit_per_host=s.max_concurrency or 0)
        timeout = aiohttp.ClientTimeout(total=6 * 3600)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            scraper = asyncio.create_task(self._scrape(session)) if s.scrape_s else None
            tasks: set[asyncio.Task] = set()
            try:
                while True:
                    for r in source.poll(self.clock.now()):
                        reason = self.rejection(r)
                        if reason is not None:
                            self._reject(r, reason)
                        else:
                            tasks.add(asyncio.create_task(self._send(session, r)))
                    nxt = source.next_arrival_s()
                    if not tasks and nxt is None:
                        if source.exhausted:
                            break
                        raise RuntimeError("nothing in flight and nothing arriving")
                    wait = None if nxt is None else max(0.0, nxt - self.clock.now())
                    if tasks:
                        done, tasks = await asyncio.wait(tasks, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
                        for t in done:
                            t.result()
                    else:
                        await asyncio.sleep(wait or 0.0)
            finally:
                for t in tasks:
                    t.cancel()
                if scraper is not None:
                    scraper.cancel()

    def _body(self, r: Request) -> dict:
        s, sp = self.settings, r.sampling
        ids = r.prompt_token_ids.tolist()
        # OpenAI's fields, and vLLM's extras only where they say something (a strict server refuses unknown ones)
        body = {"model": s.model, "stream": True, "stream_options": {"include_usage": True},
                "temperature": sp.temperature, "top_p": sp.top_p, "seed": sp.seed}
        if s.token_ids:
            body["return_token_ids"] = True
        if sp.ignore_eos:
            body["ignore_eos"] = True
        if sp.top_k:
            body["top_k"] = sp.top_k
        if sp.min_p:
            body["min_p"] = sp.min_p
        if sp.stop_token_ids:
            body["stop_token_ids"] = list(sp.stop_token_ids)
        if s.tokenizer is not None:  # as text, less what the server's tokenisation adds itself (Llama's BOS: else two)
            added = s.tokenizer.added_ids
            text = s.tokenizer.decode(ids[len(added):] if ids[:len(added)] == added else ids, skip_special_tokens=False)
        if s.kind == "chat":
            assert s.tokenizer is not None
            body["messages"] = [{"role": "user", "content": text}]
            body["max_completion_tokens"] = r.max_new_tokens
        else:
            body["prompt"] = text if s.tokenizer is not None else ids
            body["max_tokens"] = r.max_new_tokens
        return body

    async def _send(self, session: aiohttp.ClientSession, r: Request) -> None:
        s = self.settings
        spent = time.perf_counter()
        headers = {"Authorization": f"Bearer {s.api_key}"} if s.api_key else {}
        url = f"{s.url}/{'chat/completions' if s.kind == 'chat' else 'completions'}"
        answer, body = Answer(), self._body(r)
        spent = time.perf_counter() - spent
        try:
            async with session.post(url, json=body, headers=headers) as resp:
                if resp.status != 200:
                    answer.error = f"HTTP {resp.status}: {_message(await resp.text())}"
                else:
                    async for line in resp.content:
                        t = time.perf_counter()
                        answer.event(line, self.clock.now())
                        spent += time.perf_counter() - t
                    if not answer.done and answer.finish_reason is None and answer.error is None:
                        answer.error = "the stream ended before its end"  # (no [DONE], no finish reason)
        except (TimeoutError, aiohttp.ClientError, ConnectionError, ValueError) as exc:  # (a line over the limit)
            answer.error = f"{type(exc).__name__}: {exc}"
        except asyncio.CancelledError:  # the run ends under it (Ctrl-C, a fault): what came is recorded first
            answer.error = answer.error or "the client's run ended before the answer did"
            self._record(r, answer)
            raise
        t = time.perf_counter()
        self._record(r, answer)
        self.client_s.append(spent + time.perf_counter() - t)
        self.source.on_finished(r)

    def _record(self, r: Request, a: Answer) -> None:
        """The answer into ``r``: each chunk's tokens at its time (ids as sent, else the text counted by the
        tokenizer), then its end. Where the server gives its usage, the output is its ``completion_tokens``:
        tokens the events did not show are added at the last one, counted ones past it dropped (a re-tokenised
        text can come out longer than what the server generated)."""
        if r.status.terminal:  # (recorded already: cancelled after it ended)
            return
        count = (a.usage or {}).get("completion_tokens")
        cap = r.max_new_tokens if not isinstance(count, int) else min(count, r.max_new_tokens)
        for when, text, ids in a.chunks:
            if ids is None:
                tok = self.settings.tokenizer
                ids = tok.encode(text, add_special_tokens=False) if tok is not None else [0]
                ids = ids or [0]
            for tok in ids[:cap - r.num_output_tokens]:
                r.append_token(int(tok), when)
        if isinstance(count, int) and a.chunks:
            while r.num_output_tokens < cap:  # tokens the events did not show: at the last one
                r.append_token(0, a.chunks[-1][0])
        if a.error is not None:
            r.end(Status.FAILED, a.error, self.clock.now())
        elif not r.num_output_tokens:
            r.end(Status.FAILED, "the server sent no token", self.clock.now())
        else:
            r.end(Status.FINISHED, a.finish_reason or "stop")

    async def _scrape(self, session: aiohttp.ClientSession) -> None:
        from harness.endpoint.scrape import read_metrics

        base = self.settings.url.removesuffix("/v1")
        while True:
            try:
                async with session.get(f"{base}/metrics") as resp:
                    if resp.status == 200:
                        self.server_metrics.append({"time_s": self.clock.now(), **read_metrics(await resp.text())})
            except (TimeoutError, aiohttp.ClientError, ConnectionError):
                pass
            await asyncio.sleep(self.settings.scrape_s or 1.0)


def _message(text: str) -> str:
    """An error body's message (vLLM's ``{"error": {"message"}}`` or OpenAI's), else the text itself."""
    import json

    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return text.strip()[:300]
    err = obj.get("error", obj) if isinstance(obj, dict) else obj
    return str(err.get("message", err))[:300] if isinstance(err, dict) else str(err)[:300]


def client_for(settings: EndpointSettings) -> type[EndpointClient]:
    """The client class bound to one run's settings (the runner builds its executors from a class)."""
    return type("EndpointClient", (EndpointClient,), {"settings": settings})
