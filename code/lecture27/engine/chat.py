"""The prompt the engine reads (§7: the OpenAI API is the narrow waist; a chat's messages are what crosses it).

A chat request's messages are rendered in the model's chat format (ChatML, the template in SmolLM2's GGUF file:
`<|im_start|>{role}\\n{content}<|im_end|>\\n` per message, a default system message when the chat has none, and
`<|im_start|>assistant\\n` after the last one). The prompt is tokenized piecewise: each segment (the system message,
every later message, every piece of a message split by the separator) is tokenized alone, so a segment has the same
tokens wherever it stands in a chat: that is what lets the connector find it again as a chunk (LMCache's chunks,
CacheBlend's reuse of a chunk that is not a prefix). The segments' tokens, concatenated, are exactly the tokens the
model is fed (tested); where a message is not split, the special tokens split the text where the segments meet, so
they are also what tokenizing the whole text gives. Where it is split they are the whole text's too, but for one
space: a separator that ends in a space (the default " # # ") gives that space to the piece after it, where the
whole text's tokenizer puts it (a word's leading space is part of the word's token: ` # # Lionel` is `Ġ# Ġ# ĠLion
el`; a piece tokenized without its space would be fed `Ġ# Ġ# Ġ L ion el`, a sequence the model never met in
training, which doubles the first token's KL that CacheBlend's reuse of the pieces costs). The first piece of a
message gets the same space, so that a document's chunk is the same first or anywhere else: the model is fed one
space the text does not have, after the message's header.

Chunks inside a message (LMCache's `blend_special_str`, the same default " # # "): RAG code puts the retrieved
documents in one user message; the application puts the separator between them, and every message after the
system message whose text holds it is cut there. Such a message gives these chunks, each reusable alone behind the
system message: its ChatML header (`<|im_start|>user\\n`), then each piece (after the separator's space) followed
by the separator's own tokens (the separator belongs to the piece before it, so a document's chunk is the same
first, last or in between, and the same in any message), then the text after the last separator with
`<|im_end|>\\n`. In the last message that tail is the question (computed fresh, the assistant's header after it);
the pieces before it are chunks. Two separators in a row give a chunk of the separator's tokens alone (no space
before them). The system message is never cut: it is the prefix every chunk is stored behind. A plain completion's
text is cut the same way: the text up to the first separator (with it) is its prefix, each later piece a chunk, the
text after the last separator the question; its tokens are exactly its whole text's.

A prompt without separators gets what it got before: a chat's messages are its chunks, so it reuses a message the
store has seen as a message, in any order; one message (or a completion) holding many documents with no separator
reuses only its exact prefix.
"""
from __future__ import annotations

from dataclasses import dataclass

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"   # the GGUF template's
ROLES = ("system", "user", "assistant", "developer", "tool")
SEPARATOR = " # # "    # LMCache's blend_special_str default: the text that cuts a message into chunks


@dataclass(frozen=True)
class Prompt:
    """A prompt as token segments: `system` (the prefix every chunk is stored behind; empty for a plain
    completion without separators), `chunks` (the chat's messages after it but the last, and the pieces of any
    message cut by the separator: each reusable alone) and `question` (the last message, or the text after its last
    separator, and the assistant's header; a completion's whole prompt, or the text after its last separator:
    computed fresh)."""
    system: tuple
    chunks: tuple             # of tuples of tokens
    question: tuple
    last_message: tuple = ()  # a chat's question without the assistant's header: stored as a chunk (a later turn's)

    @property
    def tokens(self) -> list:
        return [*self.system, *(t for c in self.chunks for t in c), *self.question]

    def __len__(self) -> int:
        return len(self.system) + sum(map(len, self.chunks)) + len(self.question)


def segment(role: str, content: str) -> str:
    return f"{IM_START}{role}\n{content}{IM_END}\n"


class _Encoder:
    """Text -> a tuple of token ids, and the separator's own tokens."""

    def __init__(self, tok, separator: str | None):
        self.tok, self.separator = tok, separator or None
        # the separator's last space goes to the piece after it (module docstring); its own tokens are the rest
        self.space = " " if separator and separator.endswith(" ") and separator.strip() else ""
        self.sep = self(separator[:len(separator) - len(self.space)]) if separator else ()

    def __call__(self, text: str) -> tuple:
        return tuple(self.tok.encode(text).ids)

    def piece(self, text: str) -> tuple:
        """A piece after a separator (or a message's first): its tokens with the separator's space before it."""
        return self(self.space + text) if text else ()

    def split(self, text: str) -> list[str] | None:
        """The pieces of `text` between separators (None: it holds none)."""
        return text.split(self.separator) if self.separator and self.separator in text else None

    def message(self, role: str, content: str) -> list[tuple]:
        """A message's chunks (module docstring): its whole segment, or its header, each piece with the separator's
        tokens, and the tail with the end of the message."""
        pieces = self.split(content)
        if pieces is None:
            return [self(segment(role, content))]
        *before, tail = pieces
        return [self(f"{IM_START}{role}\n"), *(self.piece(p) + self.sep for p in before),
                self.piece(tail) + self(f"{IM_END}\n")]


def chat_prompt(tok, messages: list[tuple[str, str]], separator: str | None = SEPARATOR) -> Prompt:
    """messages: (role, content) pairs, at least one. The chat's Prompt (module docstring); separator None or "":
    messages are never cut."""
    if messages[0][0] != "system":
        messages = [("system", DEFAULT_SYSTEM), *messages]
    enc = _Encoder(tok, separator)
    system = enc(segment(*messages[0]))
    rest = [enc.message(role, content) for role, content in messages[1:]]
    header = enc(f"{IM_START}assistant\n")
    if not rest:   # only a system message: it is the question
        return Prompt(system=(), chunks=(), question=system + header)
    *earlier, last = rest
    chunks = tuple(c for m in earlier for c in m) + tuple(last[:-1])
    return Prompt(system=system, chunks=chunks, question=last[-1] + header, last_message=last[-1])


def completion_prompt(tok, text: str | None = None, tokens: list[int] | None = None,
                      separator: str | None = SEPARATOR) -> Prompt:
    """A plain completion's prompt (text, or token ids as the API allows): one segment, reused as a prefix only;
    a text holding the separator is cut as the module docstring says (token ids never are)."""
    if tokens is not None:
        return Prompt(system=(), chunks=(), question=tuple(tokens))
    enc = _Encoder(tok, separator)
    pieces = enc.split(text)
    if pieces is None:
        return Prompt(system=(), chunks=(), question=enc(text))
    first, *middle, tail = pieces
    return Prompt(system=enc(first) + enc.sep, chunks=tuple(enc.piece(p) + enc.sep for p in middle),
                  question=enc.piece(tail))
