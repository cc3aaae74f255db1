"""Text ↔ token ids for the HTTP front end and client: a checkpoint's own ``tokenizer.json`` (Hugging Face's
tokenizers library) with its chat template, or, for the presets, a byte tokenizer of the preset's vocabulary.

A prompt given as token ids needs neither. As vLLM does: a completion's prompt is encoded with the tokenizer's
special tokens (BOS where its post-processor adds one), a chat's rendered template without (the template writes
its own), and output text skips special tokens unless a request says ``skip_special_tokens: false``. A chat
template renders as transformers' ``apply_chat_template`` renders it: a sandboxed, immutable Jinja environment
with ``trim_blocks`` and ``lstrip_blocks``, ``raise_exception``, ``tojson`` and the tokenizer's ``bos_token`` and
``eos_token`` (its config's strings). The byte tokenizer maps byte b to id ``BYTE_OFFSET + b`` (ids below it
are the specials: 0 pad, 1 bos, 2 eos, as the presets' configs say; it adds none to a prompt); an id outside
the byte range decodes to ``<id>``, so a random model's output stays readable and every id is accounted for. A
chat without a template is the documented plain join ``role: content`` per line, then ``assistant:``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

from harness.errors import UserError

BYTE_OFFSET = 3  # ids 0, 1, 2: pad, bos, eos


class Tokenizer(Protocol):
    added_ids: list[int]  # the ids encoding adds to any text (BOS, where the post-processor adds one)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

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
        self.added_ids: list[int] = []  # (encoding adds no special token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [BYTE_OFFSET + b for b in text.encode()]  # (no post-processor: no special token added)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        out, raw = [], bytearray()
        for i in ids:
            if BYTE_OFFSET <= i < BYTE_OFFSET + 256:
                raw.append(i - BYTE_OFFSET)
                continue
            if skip_special_tokens and 0 <= i < BYTE_OFFSET:
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
        try:
            self.tok = HFTokenizer.from_file(str(d / "tokenizer.json"))
        except Exception as exc:  # (the library raises a bare Exception for a file it cannot parse)
            raise UserError(f"{d / 'tokenizer.json'}: not a tokenizer the tokenizers library reads ({exc})") from None
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=False)  # (transformers' ``vocab_size``)
        self.added_ids = self.tok.encode("").ids  # what encoding adds to any text (Llama: BOS)
        path = d / "tokenizer_config.json"
        config = json.loads(path.read_text()) if path.is_file() else {}
        self.template = chat_template(d, config)
        specials = {name: _token_text(config.get(name)) for name in ("bos_token", "eos_token")}
        self.specials = {k: v for k, v in specials.items() if v is not None}  # (unset: undefined, as transformers)
        self._compiled = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def chat(self, messages: list[dict]) -> str:
        if not self.template:
            return plain_chat(messages)
        if self._compiled is None:
            self._compiled = chat_environment().from_string(self.template)
        return self._compiled.render(messages=messages, add_generation_prompt=True, **self.specials)


def chat_template(d: Path, config: dict) -> str | None:
    """A checkpoint's chat template: ``chat_template.jinja`` (where transformers 5 saves it), else
    ``chat_template.json``'s, else ``tokenizer_config.json``'s; None without one."""
    if (d / "chat_template.jinja").is_file():
        return (d / "chat_template.jinja").read_text()
    if (d / "chat_template.json").is_file():
        return json.loads((d / "chat_template.json").read_text()).get("chat_template")
    return config.get("chat_template")


def _token_text(token: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken's dict (its ``content``)."""
    return token.get("content") if isinstance(token, dict) else token  # type: ignore[return-value]


def chat_environment():  # (jinja2 is imported here, on a chat's first render)
    """transformers' chat-template environment (``_compile_jinja_template``): sandboxed and immutable (a template
    from a checkpoint runs no arbitrary code), ``trim_blocks``/``lstrip_blocks``, loop controls, ``tojson`` as
    transformers writes it, ``raise_exception`` and ``strftime_now``."""
    from datetime import datetime

    import jinja2
    import jinja2.ext  # (loopcontrols: not loaded by ``import jinja2``)
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: object, ensure_ascii: bool = False, indent: int | None = None, separators: tuple | None = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class IncrementalText:
    """A stream's text, a step's tokens at a time, each decoded once or twice however long the stream grows (Hugging
    Face TGI's ``decode_token``, vLLM's incremental detokenizer): the tokens since the last text sent are decoded
    with the previous step's as context, and only what they add goes out. Text that ends in an unfinished
    character (U+FFFD, a byte sequence cut between tokens) waits for the next tokens, or for ``flush``. Decoding the
    whole output each step made a stream quadratic in its length: 58% of serve's event loop at 256 streams of
    1,024 tokens."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix = self.read = 0  # ids[prefix:read]: the context already sent; ids[read:]: not sent yet

    def add(self, new: list[int]) -> str:
        self.ids += new
        return self._delta(final=False)

    def flush(self) -> str:
        """What is held back, at the stream's end (an unfinished character goes out as it decodes)."""
        return self._delta(final=True)

    def _delta(self, final: bool) -> str:
        sent = self.tokenizer.decode(self.ids[self.prefix:self.read], self.skip)
        text = self.tokenizer.decode(self.ids[self.prefix:], self.skip)
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
