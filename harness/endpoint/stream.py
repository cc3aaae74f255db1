"""What one streamed answer of an OpenAI-compatible server holds, read event by event: its text and token ids
(where the server sends them: vLLM's and slotbench's ``return_token_ids``), its usage, its finish reason, or an
error. One server-sent event is one chunk: the tokens in it arrived together. An event that is not an object of
the protocol's shape (``data: 7``, ``data: [1]``, a choice that is not an object, ids that are not integers) is
this answer's error — its request fails with the reason, what came before it stays — never an exception that
would end the client's other requests."""

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
        if self.error is not None:  # the answer failed: what came after is not recorded
            return
        try:
            self._read(json.loads(data), now)
        except (ValueError, TypeError, AttributeError) as exc:  # (JSONDecodeError is a ValueError)
            self.error = self.error or f"a malformed event ({exc}): {data[:200]!r}"

    def _read(self, obj: object, now: float) -> None:
        if not isinstance(obj, dict):
            raise TypeError(f"not an object: {type(obj).__name__}")
        if "error" in obj:
            err = obj["error"]
            self.error = err.get("message", str(err)) if isinstance(err, dict) else str(err)
            return
        if obj.get("usage"):
            if not isinstance(obj["usage"], dict):
                raise TypeError("usage is not an object")
            self.usage = obj["usage"]
        choices = obj.get("choices") or []
        if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
            raise TypeError("choices is not a list of objects")
        for c in choices:
            text = c.get("text")
            if text is None:
                text = (c.get("delta") or {}).get("content") or ""
            ids = c.get("token_ids")
            if not isinstance(text, str) or (ids is not None and not (
                    isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in ids))):
                raise TypeError("a choice's text is not a string or its token_ids not integers")
            if text or ids:
                self.chunks.append((now, text, list(ids) if ids is not None else None))
            if c.get("finish_reason"):
                self.finish_reason = str(c["finish_reason"])

    @property
    def text(self) -> str:
        return "".join(t for _, t, _ in self.chunks)
