"""Text <-> token ids and chat rendering for one model, over a `tokenizers.Tokenizer` backend."""

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Tokens that end an assistant turn (or a document) in common chat vocabularies. A chat model
# stops at any of them that its vocabulary has, in addition to its declared eos.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>",
                      "<|endoftext|>", "<|end_of_text|>")


class Tokenizer:
    """Text <-> token ids and chat rendering for one model.

    `eos_token_ids` holds the declared eos, any `extra_eos_token_ids`, and -- when the model has a
    chat template -- the ids of END_OF_TURN_TOKENS present in the vocabulary. Generation stops at
    any of them.
    """

    def __init__(self, backend: tokenizers.Tokenizer, chat_template: str | None, bos_token: str | None,
                 eos_token: str | None, extra_eos_token_ids: Iterable[int] = ()) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id: int | None = self._id_of(bos_token)
        eos_ids = set(extra_eos_token_ids)
        eos_id = self._id_of(eos_token)
        if eos_id is not None:
            eos_ids.add(eos_id)
        if chat_template is not None:
            eos_ids.update(i for i in map(self._id_of, END_OF_TURN_TOKENS) if i is not None)
        self.eos_token_ids: frozenset[int] = frozenset(eos_ids)
        # each id's bytes where the vocabulary is byte-level (~55 ms for 49k tokens), for streaming
        self.token_bytes: tuple[bytes, ...] | None = byte_level_table(backend)
        self._template: jinja2.Template | None = None

    @classmethod
    def from_file(cls, tokenizer_json: Path, tokenizer_config: dict[str, Any] | None,
                  extra_eos_token_ids: Iterable[int] = ()) -> "Tokenizer":
        """From a HF `tokenizer.json` and the parsed `tokenizer_config.json` (None if absent)."""
        config = tokenizer_config or {}
        return cls(
            backend=tokenizers.Tokenizer.from_file(str(tokenizer_json)),
            chat_template=config.get("chat_template"),
            bos_token=_token_content(config.get("bos_token")),
            eos_token=_token_content(config.get("eos_token")),
            extra_eos_token_ids=extra_eos_token_ids,
        )

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special tokens written in the text (`<|im_start|>`) stay whole.

        `add_special_tokens=True` applies the backend's post-processor (e.g. a leading BOS).
        Runs without the interpreter lock (the batch call releases it; ``encode`` does not):
        a 100,000-character prompt held every other thread of a daemon for 76 ms, health
        answers included.
        """
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> str:
        """The prompt text the model's chat template makes of `messages`, as HF apply_chat_template.

        Raises ValueError when the model has no chat template or a message is not a mapping of
        string `role` and `content`; jinja2.TemplateError when the template itself rejects the chat.
        """
        if self.chat_template is None:
            raise ValueError("this model has no chat template; pass prompt text or token ids instead")
        plain = [_check_message(i, m) for i, m in enumerate(messages)]
        return self._compiled().render(
            messages=plain, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "",
        )

    def encode_chat(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of `render_chat(...)`; no special tokens are added beyond what the template writes."""
        return self.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens=False)

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    def _compiled(self) -> jinja2.Template:
        if self._template is None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(self.chat_template)
        return self._template


def byte_level_table(backend: tokenizers.Tokenizer) -> tuple[bytes, ...] | None:
    """Each id's bytes as ``decode`` (skipping special tokens) spells them, b"" for a special
    token, where decoding is the UTF-8 of their concatenation (invalid bytes read U+FFFD): a
    byte-level BPE vocabulary (GPT-2's ``ByteLevel`` decoder alone) whose added tokens are all
    special. None for any other kind, whose text only ``decode`` knows."""
    added = backend.get_added_tokens_decoder()
    if not isinstance(backend.decoder, tokenizers.decoders.ByteLevel) or not all(t.special for t in added.values()):
        return None
    table = [b""] * backend.get_vocab_size(with_added_tokens=True)
    for token, i in backend.get_vocab(with_added_tokens=True).items():
        if i not in added:
            try:
                table[i] = bytes([_BYTE_OF_CHAR[c] for c in token])
            except KeyError:  # a character outside the alphabet: not a byte-level vocabulary
                return None
    return tuple(table)


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: printable Latin-1 bytes stand for
    themselves, the other 68 for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}


_BYTE_OF_CHAR = _byte_level_alphabet()


def _check_message(index: int, message: Mapping[str, str]) -> dict[str, str]:
    if not isinstance(message, Mapping):
        raise ValueError(f"messages[{index}]: expected a mapping with 'role' and 'content', got {type(message).__name__}")
    for key in ("role", "content"):
        if not isinstance(message.get(key), str):
            raise ValueError(f"messages[{index}].{key}: expected a string, got {message.get(key)!r}")
    return dict(message)


def _token_content(token: str | Mapping[str, Any] | None) -> str | None:
    """A special token as HF configs write it: a plain string or `{"content": ...}`."""
    if isinstance(token, Mapping):
        return token.get("content")
    return token


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # NOTE: jinja's own tojson escapes HTML characters; HF templates expect plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
