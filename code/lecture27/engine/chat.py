"""The prompt the engine reads (§7: the OpenAI API is the narrow waist; a chat's messages are what crosses it).

A chat request's messages are rendered in the model's chat format (ChatML, the template in SmolLM2's GGUF file:
`<|im_start|>{role}\\n{content}<|im_end|>\\n` per message, a default system message when the chat has none, and
`<|im_start|>assistant\\n` after the last one). Each segment (the system message, every later message) is
tokenized alone, so a message has the same tokens wherever it stands in a chat: that is what lets the connector
find it again as a chunk (LMCache's chunks, CacheBlend's reuse of a chunk that is not a prefix). The special
tokens split the text where the segments meet, so the segments' tokens are the whole prompt's (tested).
"""
from __future__ import annotations

from dataclasses import dataclass

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"   # the GGUF template's
ROLES = ("system", "user", "assistant", "developer", "tool")


@dataclass(frozen=True)
class Prompt:
    """A prompt as token segments: `system` (the prefix every chunk is stored behind; empty for a plain
    completion), `chunks` (the chat's messages after it but the last: each reusable alone) and `question` (the
    last message and the assistant's header, or a completion's whole prompt: computed fresh)."""
    system: tuple
    chunks: tuple             # of tuples of tokens
    question: tuple
    last_message: tuple = ()  # the last message's own segment (question without the header): stored as a chunk

    @property
    def tokens(self) -> list:
        return [*self.system, *(t for c in self.chunks for t in c), *self.question]

    def __len__(self) -> int:
        return len(self.system) + sum(map(len, self.chunks)) + len(self.question)


def segment(role: str, content: str) -> str:
    return f"{IM_START}{role}\n{content}{IM_END}\n"


def chat_prompt(tok, messages: list[tuple[str, str]]) -> Prompt:
    """messages: (role, content) pairs, at least one. The chat's Prompt (module docstring)."""
    if messages[0][0] != "system":
        messages = [("system", DEFAULT_SYSTEM), *messages]
    def enc(text: str) -> tuple:
        return tuple(tok.encode(text).ids)

    system = enc(segment(*messages[0]))
    rest = [enc(segment(role, content)) for role, content in messages[1:]]
    header = enc(f"{IM_START}assistant\n")
    if not rest:   # only a system message: it is the question
        return Prompt(system=(), chunks=(), question=system + header)
    return Prompt(system=system, chunks=tuple(rest[:-1]), question=rest[-1] + header, last_message=rest[-1])


def completion_prompt(tok, text: str | None = None, tokens: list[int] | None = None) -> Prompt:
    """A plain completion's prompt (text, or token ids as the API allows): one segment, reused as a prefix only."""
    return Prompt(system=(), chunks=(), question=tuple(tokens if tokens is not None else tok.encode(text).ids))
