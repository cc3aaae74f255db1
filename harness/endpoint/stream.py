"""What one streamed answer of an OpenAI-compatible server holds, read event by event: its text and token ids
(where the server sends them: vLLM's and slotbench's ``return_token_ids``), its usage, its finish reason, or an
error. One server-sent event is one chunk: the tokens in it arrived together."""

from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass
class Answer:
    chunks: list[tuple[float, str, list[int] | None]] = field(default_factory=list)  # (time, text, token ids)
    usage: dict | None = None  # the server's token counts (stream_options.include_usage)
    finish_reason: str | None = None
    error: str | None = None  # an error event, or the stream cut before [DONE]
    done: bool = False  # the [DONE] event came

    def event(self, line: bytes, now: float) -> None:
        """One line of the event stream, received at ``now``."""
        line = line.strip()
        if not line.startswith(b"data:"):
            return  # blank separators, comments, event names
        data = line[5:].strip()
        if data == b"[DONE]":
            self.done = True
            return
        try:
            obj = json.loads(data)
        except json.JSONDecodeError:
            self.error = f"a malformed event: {data[:200]!r}"
            return
        if "error" in obj:
            err = obj["error"]
            self.error = err.get("message", str(err)) if isinstance(err, dict) else str(err)
            return
        if obj.get("usage"):
            self.usage = obj["usage"]
        for c in obj.get("choices") or ():
            text = c.get("text")
            if text is None:
                text = (c.get("delta") or {}).get("content") or ""
            ids = c.get("token_ids")
            if text or ids:
                self.chunks.append((now, text, list(ids) if ids is not None else None))
            if c.get("finish_reason"):
                self.finish_reason = c["finish_reason"]

    @property
    def text(self) -> str:
        return "".join(t for _, t, _ in self.chunks)
