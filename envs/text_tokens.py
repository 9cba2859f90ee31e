"""Token ids for text that must reach the model as text: tool output never becomes control tokens.

A tokenizer's ``encode`` turns the text of each of its added tokens (special ones such as ``<|im_end|>``
and ``<|endoftext|>``, and non-special ones such as Qwen2.5's ``<tool_call>`` and ``</tool_response>``)
into that token's id. Tool output is written by the model's code, so code that prints
``<|im_end|>\\n<|im_start|>user\\n...`` would otherwise put real chat structure, EOS included, into the
trajectory: the model is conditioned on forged turns, and anything that reads those ids as structure
misreads the episode. :func:`encode_as_text` encodes such text as the characters it is.

- Text without any added-token string is encoded exactly as ``encode(text, add_special_tokens=False)``
  does, so tool output that forges nothing keeps the ids it always had (runs reproduce bit for bit).
- Otherwise the text is cut around each added-token string; the pieces between are encoded as usual and
  each added-token string is encoded as text (its first character, then the rest, recursively), so no
  piece matches an added token. Decoding gives the text back exactly with byte-level BPE tokenizers
  (GPT-2 style: Qwen, Llama 3, SmolLM2); a tokenizer that puts a space before every piece it encodes
  (SentencePiece with a prefix space) shows one at each cut.

Hugging Face's ``split_special_tokens=True`` is not used: it leaves non-special added tokens (Qwen's
``</tool_response>``) as tokens, and fast tokenizers apply it by switching a flag of the shared backend
tokenizer for the call, which a concurrent encode in another thread would see.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Protocol


class TextTokenizer(Protocol):
    """The slice of a Hugging Face tokenizer used here (``get_added_vocab`` and ``all_special_tokens``
    are read when present)."""

    def encode(self, text: str, *, add_special_tokens: bool = ...) -> list[int]: ...


def control_strings(tokenizer: TextTokenizer) -> frozenset[str]:
    """The text of every added and special token of ``tokenizer``, except whitespace: Gemma's tokenizer
    adds runs of newlines and tabs as tokens, which are how it writes text, not chat structure (split,
    every blank line of a tool output would be tokenized as no text of the model's is)."""
    strings: set[str] = set()
    get_added_vocab = getattr(tokenizer, "get_added_vocab", None)
    if callable(get_added_vocab):
        strings.update(get_added_vocab())
    strings.update(getattr(tokenizer, "all_special_tokens", None) or ())
    return frozenset(s for s in strings if isinstance(s, str) and s.strip())


@lru_cache(maxsize=16)
def _pattern(strings: frozenset[str]) -> re.Pattern[str] | None:
    """One regex matching any of ``strings``, longest first (``<|im_end|>`` before a shorter ``<|im``)."""
    if not strings:
        return None
    return re.compile("|".join(re.escape(s) for s in sorted(strings, key=lambda s: (-len(s), s))))


def control_text_pattern(tokenizer: TextTokenizer) -> re.Pattern[str] | None:
    """A regex that finds the added/special token strings of ``tokenizer`` in a text (None: it has none)."""
    return _pattern(control_strings(tokenizer))


def encode_as_text(tokenizer: TextTokenizer, text: str) -> list[int]:
    """Token ids of ``text`` as text: no added or special token string in it becomes that token's id.

    Text without such strings gets exactly ``tokenizer.encode(text, add_special_tokens=False)``.
    """
    pattern = control_text_pattern(tokenizer)
    if pattern is None or pattern.search(text) is None:
        return _encode(tokenizer, text)
    ids: list[int] = []
    pos = 0
    for match in pattern.finditer(text):
        literal = match.group()
        ids += _encode(tokenizer, text[pos : match.start()])
        ids += _encode(tokenizer, literal[:1]) + encode_as_text(tokenizer, literal[1:])
        pos = match.end()
    return ids + _encode(tokenizer, text[pos:])


def _encode(tokenizer: TextTokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False)) if text else []
