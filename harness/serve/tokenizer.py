"""Text ↔ token ids for the HTTP front end and client: a checkpoint's own ``tokenizer.json`` (Hugging Face's
tokenizers library) with its chat template, or, for the presets, a byte tokenizer of the preset's vocabulary.

A prompt given as token ids needs neither. The byte tokenizer maps byte b to id ``BYTE_OFFSET + b`` (ids below
it are the specials: 0 pad, 1 bos, 2 eos, as the presets' configs say); an id outside the byte range decodes to
``<id>``, so a random model's output stays readable and every id is accounted for. A chat without a template
is the documented plain join ``role: content`` per line, then ``assistant:``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

BYTE_OFFSET = 3  # ids 0, 1, 2: pad, bos, eos


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def chat(self, messages: list[dict]) -> str:
        """The prompt text of a chat request."""


def plain_chat(messages: list[dict]) -> str:
    """The documented join of a chat without a template: ``role: content`` per message, then ``assistant:``."""
    return "".join(f"{m.get('role', 'user')}: {m.get('content', '')}\n" for m in messages) + "assistant:"


class ByteTokenizer:
    """Bytes of UTF-8 text as ids ``BYTE_OFFSET + b`` (a preset's vocabulary must hold the 256 of them)."""

    def __init__(self, vocab_size: int) -> None:
        if vocab_size < BYTE_OFFSET + 256:
            raise ValueError(f"a byte tokenizer needs a vocabulary of {BYTE_OFFSET + 256} ids, not {vocab_size}")
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return [BYTE_OFFSET + b for b in text.encode()]

    def decode(self, ids: list[int]) -> str:
        out, raw = [], bytearray()
        for i in ids:
            if BYTE_OFFSET <= i < BYTE_OFFSET + 256:
                raw.append(i - BYTE_OFFSET)
                continue
            out.append(raw.decode(errors="replace"))
            raw.clear()
            out.append(f"<{i}>")
        out.append(raw.decode(errors="replace"))
        return "".join(out)

    def chat(self, messages: list[dict]) -> str:
        return plain_chat(messages)


class CheckpointTokenizer:
    """A checkpoint directory's ``tokenizer.json``, and the chat template of its ``tokenizer_config.json``."""

    def __init__(self, directory: str | Path) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        d = Path(directory)
        self.tok = HFTokenizer.from_file(str(d / "tokenizer.json"))
        config = d / "tokenizer_config.json"
        self.template = json.loads(config.read_text()).get("chat_template") if config.is_file() else None

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    def chat(self, messages: list[dict]) -> str:
        if not self.template:
            return plain_chat(messages)
        import jinja2

        return jinja2.Environment().from_string(self.template).render(messages=messages, add_generation_prompt=True)


class IncrementalText:
    """A stream's text, a step's tokens at a time, each decoded once or twice however long the stream grows (Hugging
    Face TGI's ``decode_token``, vLLM's incremental detokenizer): the tokens since the last text sent are decoded
    with the previous step's as context, and only what they add goes out. Text that ends in an unfinished
    character (U+FFFD, a byte sequence cut between tokens) waits for the next tokens, or for ``flush``. Decoding the
    whole output each step made a stream quadratic in its length: 58% of serve's event loop at 256 streams of
    1,024 tokens."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = self.read = 0  # ids[prefix:read]: the context already sent; ids[read:]: not sent yet

    def add(self, new: list[int]) -> str:
        self.ids += new
        return self._delta(final=False)

    def flush(self) -> str:
        """What is held back, at the stream's end (an unfinished character goes out as it decodes)."""
        return self._delta(final=True)

    def _delta(self, final: bool) -> str:
        sent = self.tokenizer.decode(self.ids[self.prefix:self.read])
        text = self.tokenizer.decode(self.ids[self.prefix:])
        if len(text) <= len(sent) or (text.endswith("\ufffd") and not final):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(sent):]


def tokenizer_for(model: str | None, vocab_size: int) -> Tokenizer | None:
    """A checkpoint's tokenizer where the directory has one, else a byte tokenizer where the vocabulary holds
    the bytes, else None (token-id prompts only)."""
    if model is not None and (Path(model) / "tokenizer.json").is_file():
        return CheckpointTokenizer(model)
    return ByteTokenizer(vocab_size) if vocab_size >= BYTE_OFFSET + 256 else None
