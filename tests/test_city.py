"""The city language and the trained city LLaMA (trains once, ~40 s on 2 idle cores, then cached)."""
import math

import pytest
import torch

from common.city import SENTENCE_LEN, CityLanguage, city_model, heldout_ce


def test_sentences_are_8_tokens_and_round_trip():
    lang = CityLanguage()
    x = lang.sample_sentences(50, torch.Generator().manual_seed(0))
    assert x.shape == (50, SENTENCE_LEN)
    for row in x.tolist():
        words = lang.decode(row).split()
        assert len(words) == 8 and words[-1] == "."
        assert lang.encode(words) == row


def test_entropy_is_exact():
    lang = CityLanguage()
    # template (4 equally likely) + city (24) + for the census template, size (5) and year (4)
    h = math.log(4) + math.log(24) + 0.25 * (math.log(5) + math.log(4))
    assert abs(lang.entropy_per_token() - h / 8) < 1e-12
    # and the sampler follows the table: empirical log-likelihood matches the entropy
    g = torch.Generator().manual_seed(1)
    idx = torch.multinomial(lang.probs, 20000, replacement=True, generator=g)
    assert abs(-lang.probs[idx].log().mean().item() / 8 - lang.entropy_per_token()) < 0.01
    # words 2..8: the first word is "the" (1/2), "in" (1/4) or one of the 24 cities (1/96 each)
    h_first = 0.5 * math.log(2) + 0.25 * math.log(4) + 0.25 * math.log(96)
    assert abs(lang.entropy_after_first_word() - (h - h_first) / 7) < 1e-12


def test_sentences_are_independent():
    """The next sentence's distribution does not depend on the previous one: sample_text draws
    every sentence from the same table, independently (checked on the first word)."""
    lang = CityLanguage()
    x = lang.sample_text(4000, 2, torch.Generator().manual_seed(2))
    a, b = x[:, 0], x[:, 8]
    the = lang.index["the"]
    p_all = (b == the).float().mean()
    p_given = (b[a == the] == the).float().mean()
    assert abs(p_all - 0.5) < 0.03 and abs(p_given - p_all) < 0.04


@pytest.mark.slow
def test_city_model_reaches_the_entropy():
    model, lang = city_model()
    meta = model.train_meta
    assert meta["ident"]["code"].startswith("city-")  # the checkpoint file's key
    ce = heldout_ce(model, lang, n_seq=256, seed=99)
    assert abs(ce - lang.entropy_per_token()) <= 0.05, (ce, lang.entropy_per_token())
    # the second call loads the cached file: same weights, no training
    again, _ = city_model()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))


@pytest.mark.slow
def test_same_seed_retrains_the_identical_model(tmp_path, monkeypatch):
    """Same machine, same seed, same thread count: --retrain gives the identical weights bit for bit
    (the trainer draws every batch from its own seeded generator; CPU kernels are deterministic at
    a fixed thread count). Another seed gives another model. Short runs of the same recipe."""
    from common import city
    monkeypatch.setenv("L27_CHECKPOINTS", str(tmp_path))
    monkeypatch.setattr(city, "TRAIN", dict(city.TRAIN, steps=40))
    a, lang = city_model(retrain=True, seed=3)
    b, _ = city_model(retrain=True, seed=3)
    c, _ = city_model(retrain=True, seed=4)
    sa, sb, sc = (m.state_dict() for m in (a, b, c))
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert heldout_ce(a, lang, n_seq=64) == heldout_ce(b, lang, n_seq=64)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)
