"""The city language and the city LLaMA (the handout's "city LLaMA of lecture 19", written here).

A tiny invented world: 24 cities, each in one of 6 countries, on one of 8 rivers, big or small.
Every sentence is exactly 8 words and independent of the sentences before it:

    the city of <city> lies in <country> .            (fact)
    the town <city> stands on river <river> .          (fact)
    <city> had <n> thousand people in <year> .         (n drawn from the city's size class, year random)
    in the city <city> people speak <language> .      (fact, through the city's country)

So three chunks of 8 tokens are three sentences, and reusing each chunk's KV computed alone loses
nothing a model needs (handout §5.2). Because the generator is a finite table of sentences with
known probabilities, the language's true entropy is exact: a model trained to convergence reaches
it, and the tests check how close.
"""
from __future__ import annotations

import random

import torch

from .checkpoints import cached_model
from .trainer import init_weights, train_lm
from .llama import LlamaConfig

SENTENCE_LEN = 8
WORLD_SEED = 27

N_CITIES, N_COUNTRIES, N_RIVERS = 24, 6, 8
YEARS = ["1800", "1850", "1900", "1950"]
SIZES = {"big": ["60", "70", "80", "90", "99"], "small": ["10", "20", "30", "40", "50"]}
TEMPLATE_PROB = [0.25, 0.25, 0.25, 0.25]


def _names(rng: random.Random, n: int, syllables: list[str], parts: int) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        w = "".join(rng.choice(syllables) for _ in range(parts))
        if w not in out:
            out.append(w)
    return out


class CityLanguage:
    """The world, its word-level tokenizer, and its sentence distribution as an explicit table."""

    def __init__(self, seed: int = WORLD_SEED):
        rng = random.Random(seed)
        syl = ["ka", "lo", "mi", "ra", "te", "vu", "sa", "no", "be", "di", "zo", "pe"]
        self.cities = _names(rng, N_CITIES, syl, 3)
        self.countries = _names(rng, N_COUNTRIES, [s.upper()[0] + s[1:] for s in syl], 2)
        self.languages = [c.lower() + "ish" for c in self.countries]
        self.rivers = _names(rng, N_RIVERS, ["ol", "an", "ur", "es", "im"], 2)
        self.country_of = {c: rng.choice(self.countries) for c in self.cities}
        self.river_of = {c: rng.choice(self.rivers) for c in self.cities}
        self.size_of = {c: rng.choice(["big", "small"]) for c in self.cities}

        sentences: list[tuple[list[str], float]] = []
        for c in self.cities:
            pc = 1 / N_CITIES
            k = self.country_of[c]
            sentences.append((f"the city of {c} lies in {k} .".split(), TEMPLATE_PROB[0] * pc))
            sentences.append((f"the town {c} stands on river {self.river_of[c]} .".split(), TEMPLATE_PROB[1] * pc))
            for n in SIZES[self.size_of[c]]:
                for y in YEARS:
                    p = TEMPLATE_PROB[2] * pc / len(SIZES[self.size_of[c]]) / len(YEARS)
                    sentences.append((f"{c} had {n} thousand people in {y} .".split(), p))
            lang = self.languages[self.countries.index(k)]
            sentences.append((f"in the city {c} people speak {lang} .".split(), TEMPLATE_PROB[3] * pc))
        assert all(len(s) == SENTENCE_LEN for s, _ in sentences)

        words = sorted({w for s, _ in sentences for w in s})
        self.vocab = words
        self.index = {w: i for i, w in enumerate(words)}
        self.table = torch.tensor([self.encode(s) for s, _ in sentences])  # (S, 8)
        self.probs = torch.tensor([p for _, p in sentences], dtype=torch.float64)
        assert abs(self.probs.sum().item() - 1) < 1e-9 and len(set(map(tuple, self.table.tolist()))) == len(sentences)

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, words: list[str] | str) -> list[int]:
        if isinstance(words, str):
            words = words.split()
        return [self.index[w] for w in words]

    def decode(self, ids) -> str:
        return " ".join(self.vocab[i] for i in ids)

    def sample_sentences(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """n independent sentences, (n, 8) token ids."""
        idx = torch.multinomial(self.probs, n, replacement=True, generator=generator)
        return self.table[idx]

    def sample_text(self, batch: int, n_sentences: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """(batch, n_sentences * 8): independent sentences side by side."""
        return self.sample_sentences(batch * n_sentences, generator).view(batch, n_sentences * SENTENCE_LEN)

    def entropy_per_token(self) -> float:
        """The language's true entropy in nats per token: H(sentence) / 8 (sentences are independent)."""
        p = self.probs
        return float(-(p * p.log()).sum()) / SENTENCE_LEN

    def entropy_after_first_word(self) -> float:
        """True entropy (nats/token) of words 2..8 of a sentence given the words before them:
        (H(sentence) - H(first word)) / 7. What a perfect model scores on a sentence whose first word
        it cannot predict (e.g. a question right after independent context sentences)."""
        p = self.probs
        first = torch.zeros(self.vocab_size, dtype=torch.float64).index_add_(0, self.table[:, 0], p)
        first = first[first > 0]
        h_first = float(-(first * first.log()).sum())
        return (float(-(p * p.log()).sum()) - h_first) / (SENTENCE_LEN - 1)


# --------------------------------------------------------------------------- the city LLaMA
# 4 layers, d = 64, 4 query heads of 16, 2 KV heads: K,V = 4 layers x 2 x 32 values x 2 B = 512 B/token.
def city_config(lang: CityLanguage) -> LlamaConfig:
    return LlamaConfig(vocab_size=lang.vocab_size, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2,
                       head_dim=16, d_ff=192)


# Initialised like the record model (common.trainer.init_weights): at llama.py's N(0, 0.02) about half
# of the seeds stayed on a plateau 0.13-0.19 nats above the entropy for the whole run (the city facts
# unlearned); at this scale each of seeds 0-6 ends within 0.004 nats of it (the held-out estimate's own noise).
TRAIN = dict(steps=700, batch=32, n_sentences=8, lr=3e-3, warmup=50, embed_std=1.0, linear_std=0.125)
SEED = 0  # training seed (a model per seed; the tests can run against another: L27_SEED, tests/conftest.py)


def heldout_ce(model, lang: CityLanguage, n_seq: int = 256, seed: int = 1234) -> float:
    """Mean cross-entropy (nats) on whole sentences after the first, i.e. every token at positions
    8.., predicted from its prefix: directly comparable with lang.entropy_per_token()."""
    g = torch.Generator().manual_seed(seed)
    x = lang.sample_text(n_seq, TRAIN["n_sentences"], g)
    with torch.no_grad():
        logits, _ = model(x[:, :-1])
    lp = torch.log_softmax(logits[:, SENTENCE_LEN - 1:], -1)
    return float(-lp.gather(-1, x[:, SENTENCE_LEN:, None]).mean())


def city_model(retrain: bool = False, seed: int | None = None):
    """(model, lang): the trained city LLaMA (trained on first call, then loaded from
    code/checkpoints/) and its language. model.train_meta holds the checkpoint's metadata.
    seed: the training seed (default SEED)."""
    seed = SEED if seed is None else seed
    lang = CityLanguage()
    T = TRAIN

    def batch_fn(step, g):
        x = lang.sample_text(T["batch"], T["n_sentences"], g)
        return x[:, :-1], x[:, 1:], torch.ones(x.shape[0], x.shape[1] - 1)

    def train_fn(model):
        init_weights(model, torch.Generator().manual_seed(seed), T["embed_std"], T["linear_std"])
        train_lm(model, batch_fn, T["steps"], T["lr"], warmup=T["warmup"], desc="city LLaMA", seed=seed)
        return {"heldout_ce": heldout_ce(model, lang), "entropy": lang.entropy_per_token()}

    model, meta = cached_model("city", city_config(lang), T, train_fn, retrain, seed)
    model.train_meta = meta
    return model, lang
