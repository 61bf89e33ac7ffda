"""The engine's parts in this process, on SmolLM2 (engine/chat.py, connector.py, generate.py): a chat's segments are
its whole prompt's tokens; a prompt served from stored prefix blocks is a full prefill's, up to float32 rounding;
blending the messages at ratio 1 is a full prefill and at ratio 0 full reuse; the store never holds blended KV;
decoding stops where it must."""
import threading

import numpy as np
import pytest
import torch

from common.gguf_llama import gguf_file
from common.llama import kv_to_array
from lecture27 import kvstore as ks
from lecture27.engine.chat import chat_prompt, completion_prompt
from lecture27.engine.connector import BLOCK_TOKENS, PIECE_TOKENS, KVConnector, Tiers, block_keys, message_keys
from lecture27.engine.generate import STORE, Engine, Request

DOCS = ["Lake Varna lies in a narrow valley carved by glaciers. Its deepest point is 212 metres below the surface.",
        "Lake Osric is wide and popular with sailors. Surveys with sonar measured its greatest depth at 147 metres.",
        "The valley that holds Lake Varna is also home to three small villages and a ski lift that runs in winter."]
QUESTION = "Which lake is deeper, Lake Varna or Lake Osric?"


def chat(order=(0, 1, 2), system="Answer from the documents.") -> list:
    return [("system", system)] + [("user", DOCS[i]) for i in order] + [("user", QUESTION)]


@pytest.fixture(scope="module")
def parts(smollm2):
    model, tok, _ = smollm2
    return model, tok, ks.model_id(gguf_file(None))


def connector(parts, **kw) -> KVConnector:
    model, _, mid = parts
    return KVConnector(model, mid, Tiers([ks.RamTier(1 << 30)], ks.kv_shape(model.cfg)), **kw)


def full(model, tokens) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens]), last=True)[0][0, -1]


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal up to float32 rounding of sums taken in another order: logits of scale S agree to ~1e-4 S."""
    return float((a - b).abs().max()) <= 2e-4 * float(b.abs().max()) + 1e-4


def store_all(con: KVConnector, prompt, done) -> None:
    now, later = con.to_store(prompt, done, done.cache, prompt.tokens)
    for key, X in now:
        con.tiers.put(key, X)
    for key, chunk in later:
        con.tiers.put(key, con.prefill_alone(key.prefix, chunk))


def test_a_chats_segments_are_its_whole_prompts_tokens(parts):
    _, tok, _ = parts
    for messages in (chat(), chat((2, 0)), [("user", "Hi!")], [("system", "Be brief."), ("user", "a\n\nb"),
                                                                 ("assistant", "ok"), ("user", "and?")]):
        p = chat_prompt(tok, messages)
        if messages[0][0] != "system":
            messages = [("system", "You are a helpful AI assistant named SmolLM, trained by Hugging Face")] + messages
        text = "".join(f"<|im_start|>{r}\n{c}<|im_end|>\n" for r, c in messages) + "<|im_start|>assistant\n"
        assert p.tokens == tok.encode(text).ids and len(p) == len(p.tokens)
    p = chat_prompt(tok, chat())
    assert len(p.chunks) == 3 and p.last_message == p.question[:len(p.last_message)]


def test_a_prompt_served_from_stored_prefix_blocks_is_a_full_prefill(parts):
    model, tok, _ = parts
    con = connector(parts)
    p = chat_prompt(tok, chat())
    first = con.prefill(p)
    assert first.reuse.path == "prefill" and first.reuse.recomputed == len(p)
    assert close(first.logits, full(model, p.tokens))
    store_all(con, p, first)
    again = con.prefill(p)
    assert again.reuse.path == "prefix" and again.reuse.prefix == len(p) - 1 and again.reuse.recomputed == 1
    assert close(again.logits, full(model, p.tokens))
    # a longer prompt that starts the same: its blocks up to the last whole one are reused, the rest prefilled
    longer = chat_prompt(tok, chat() + [("assistant", "Lake Varna."), ("user", "By how much?")])
    done = con.prefill(longer)
    assert done.reuse.path == "prefix" and len(p) - BLOCK_TOKENS < done.reuse.prefix < len(p)
    assert close(done.logits, full(model, longer.tokens))


def test_blend_at_ratio_1_is_a_full_prefill_and_at_ratio_0_full_reuse(parts):
    model, tok, mid = parts
    for ratio in (1.0, 0.0):
        con = connector(parts, ratio=ratio)
        p = chat_prompt(tok, chat())
        store_all(con, p, con.prefill(p))
        moved = chat_prompt(tok, chat((2, 0, 1)))
        done = con.prefill(moved)
        assert done.reuse.path == "blend" and done.reuse.blended == sum(map(len, moved.chunks))
        if ratio == 1.0:
            assert close(done.logits, full(model, moved.tokens))
        else:   # the chunks as stored, shifted to their places; the question over them
            keys = ks.chunk_keys(mid, moved.system, moved.chunks)
            pre = ks.assemble(keys, [con.tiers.get(k)[0] for k in keys], model.cfg)
            with torch.no_grad():
                reuse = model(torch.tensor([list(moved.question)]), cache=pre, last=True)[0][0, -1]
            assert close(done.logits, reuse)
            assert not close(done.logits, full(model, moved.tokens))   # reuse without recompute is not exact


def test_the_store_holds_only_exact_kv(parts):
    """After a blended request, every prefix block and message chunk in the store is what a full prefill (of the
    prefix, of the message behind the system message) computes: blended rows are never stored."""
    model, tok, mid = parts
    con = connector(parts)
    p = chat_prompt(tok, chat())
    store_all(con, p, con.prefill(p))
    moved = chat_prompt(tok, chat((1, 2, 0)))
    done = con.prefill(moved)
    assert done.reuse.path == "blend"
    store_all(con, moved, done)
    with torch.no_grad():
        exact = kv_to_array(model(torch.tensor([moved.tokens]))[1])[0]
    S = len(moved.system)
    for a, b, key in block_keys(mid, moved.tokens):
        X, _ = con.tiers.get(key)
        if b > S:   # past the system message the request's KV was blended: none of it is a prefix block
            assert X is None, (a, b)
        elif X is not None:
            assert np.abs(X - exact[a:b]).max() <= 1e-3 * np.abs(exact[a:b]).max(), (a, b)
    X, _ = con.tiers.get(ks.ChunkKey(mid, tuple(moved.system)))
    assert X is not None and np.abs(X - exact[:S]).max() <= 1e-3 * np.abs(exact[:S]).max()
    for key, chunk in zip(message_keys(mid, moved), (*moved.chunks, moved.last_message)):
        X, _ = con.tiers.get(key)
        want = ks.chunk_kvs(model, moved.system, [chunk])[-1]
        assert X is not None and np.abs(X - want).max() <= 1e-3 * np.abs(want).max()


def test_a_hit_in_a_lower_tier_is_copied_up_and_a_put_reaches_every_tier(parts):
    model, _, mid = parts
    ram, disk = ks.RamTier(1 << 30), ks.RamTier(1 << 30)
    tiers = Tiers([ram, disk], ks.kv_shape(model.cfg))
    key = ks.ChunkKey(mid, (1, 2, 3))
    X = np.random.default_rng(0).standard_normal((3, *ks.kv_shape(model.cfg))).astype(np.float16).astype(np.float32)
    tiers.put(key, X)
    name = tiers.stores[0].name(key)
    assert ram.has(name) and disk.has(name)
    ram.discard(name)
    got, tier = tiers.get(key)
    assert tier == "ram" == ram.name and np.array_equal(got, X)
    assert ram.has(name)   # copied back up
    assert tiers.get(ks.ChunkKey(mid, (9,)))[0] is None
    made = []                 # a put whose KV is a function: called only when a tier lacks the record
    tiers.put(key, lambda: made.append(1) or X)
    assert made == []
    ram.discard(name)
    tiers.put(key, lambda: made.append(1) or X)
    assert made == [1] and ram.has(name) and np.array_equal(tiers.get(key)[0], X)


def events(engine: Engine, prompt, **kw) -> list:
    done, out = threading.Event(), []

    def emit(kind, **data):
        out.append((kind, data))
        if kind in ("end", "error"):
            done.set()
    engine.submit(Request(prompt=prompt, emit=emit, **kw))
    assert done.wait(120)
    return out


def test_decoding_stops_at_max_tokens_a_stop_string_and_the_end_of_turn(parts):
    model, tok, _ = parts
    con = KVConnector(model, "m", None)
    ends = {tok.token_to_id("<|im_end|>")}
    engine = Engine(model, tok, con, ends, threads=1).start()
    try:
        p = completion_prompt(tok, "The days of the week are Monday, Tuesday,")
        ev = events(engine, p, max_tokens=6, temperature=0)
        text = "".join(d["delta"] for k, d in ev if k == "text")
        assert ev[0][0] == "start" and ev[-1] == ("end", {"finish_reason": "length", "tokens": 6, "kl": None})
        # the same greedy tokens as decoding by hand with the cache
        with torch.no_grad():
            logits, cache = model(torch.tensor([p.tokens]), last=True)
            ids = []
            for _ in range(6):
                ids.append(int(logits[0, -1].argmax()))
                logits, cache = model(torch.tensor([[ids[-1]]]), cache=cache, last=True)
        assert text == tok.decode(ids)
        stop = text.split()[1]   # a word the answer holds: the text ends before it
        ev = events(engine, p, max_tokens=6, temperature=0, stop=(stop,))
        cut = "".join(d["delta"] for k, d in ev if k == "text")
        assert cut == text[:text.index(stop)] and ev[-1][1]["finish_reason"] == "stop"
        a = events(engine, p, max_tokens=5, temperature=0.8, seed=7)
        b = events(engine, p, max_tokens=5, temperature=0.8, seed=7)
        assert [d for k, d in a if k == "text"] == [d for k, d in b if k == "text"]   # a seed makes sampling repeat
    finally:
        engine.stop()
    ended = Engine(model, tok, con, {ids[2]}, threads=1).start()   # the third token ends the answer, as an end of turn
    try:
        ev = events(ended, p, max_tokens=6, temperature=0)
        assert ev[-1][1]["finish_reason"] == "stop" and ev[-1][1]["tokens"] == 2
        assert "".join(d["delta"] for k, d in ev if k == "text") == tok.decode(ids[:2])
    finally:
        ended.stop()


class _Spy:
    """The connector's model, logging each forward's tokens; its second forward calls `then` (once)."""
    def __init__(self, model, then):
        self.model, self.then, self.log = model, then, []

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, x, **kw):
        self.log.append(x.shape[1])
        if len(self.log) == 2:
            self.then()
        return self.model(x, **kw)


def test_a_store_job_steps_aside_for_a_request_that_comes_while_it_runs(parts):
    """A message stored alone is prefilled PIECE_TOKENS at a time: a request that comes during the first piece is
    answered before the second, and the record is the message prefilled in one go, up to float32 rounding."""
    model, tok, mid = parts
    con = connector(parts)
    system, chunk = tuple(chat_prompt(tok, chat()).system), tuple(range(1000, 1000 + 2 * PIECE_TOKENS + 5))
    key = ks.ChunkKey(mid, chunk, system)
    engine = Engine(model, tok, con, {tok.token_to_id("<|im_end|>")}, threads=1)
    done = threading.Event()

    def emit(kind, **data):
        if kind == "end":
            con.model.log.append("answered")
            done.set()
    request = Request(prompt=completion_prompt(tok, "Hello"), emit=emit, max_tokens=1)
    con.model = _Spy(model, lambda: engine.submit(request))
    engine._put(STORE, (key, con.prefill_pieces(system, chunk)))
    engine.start()
    try:
        assert done.wait(120)
        while engine.load()["store_jobs"] or not con.tiers.has(key):
            assert engine.model_thread.is_alive()
            done.wait(0.05)
    finally:
        engine.stop()
    log = con.model.log
    assert log[:2] == [len(system), PIECE_TOKENS] and log[-2:] == [PIECE_TOKENS, 5]
    assert "answered" in log and log.index("answered") < len(log) - 2
    want = ks.chunk_kvs(model, system, [chunk])[-1]
    X, _ = con.tiers.get(key)
    assert np.abs(X - want).max() <= 1e-3 * np.abs(want).max()
