"""The answer a context's KV gives (handout §4.2: streaming must not change what the model says): the question
read after the KV, the first answer token's distribution and the greedy answer, against those of the full
prefill."""
from __future__ import annotations

import hashlib
import time

import torch

from common.llama import KVCache, greedy, kl_divergence

ANSWER_TOKENS = 8         # greedy tokens compared with the full prefill's


def answer_after(model, cache: KVCache, question: tuple, n: int):
    """(log-probs of the first answer token, n greedy tokens) after `question` attends to `cache`."""
    with torch.no_grad():
        logits, cache = model(torch.tensor([question]), cache=cache, last=True)
    return logits[0, -1].float().log_softmax(-1), tuple(greedy(model, logits[:, -1], cache, n)[0])


class AnswerCheck:
    """The answer a run's KV gives, against the full prefill's: (first token's KL, same greedy tokens). `prep`
    is the measured context (measure.Prepared: its question, ref_logp and ref_answer). The answer is a
    function of the KV's bits, so a KV equal bit for bit to one already checked (the same choices decode and
    recompute to the same values) gives that one's answer: computed once per KV."""

    def __init__(self, prep, model):
        self.prep, self.model, self.seen = prep, model, {}
        self.computed = self.reused = 0
        self.seconds = 0.0                # spent answering

    def __call__(self, cache: KVCache) -> tuple[float, bool]:
        h = hashlib.sha256()
        for t in (*cache.k, *cache.v, *[cache.pos] * (cache.pos is not None)):
            h.update(t.contiguous().numpy().tobytes())
        key = h.hexdigest()
        if key in self.seen:
            self.reused += 1
            return self.seen[key]
        t = time.perf_counter()
        first, answer = answer_after(self.model, cache, self.prep.question, len(self.prep.ref_answer))
        self.seconds += time.perf_counter() - t
        self.computed += 1
        self.seen[key] = float(kl_divergence(self.prep.ref_logp, first)), answer == self.prep.ref_answer
        return self.seen[key]
