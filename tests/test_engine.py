"""The engine's parts in this process (engine/chat.py, runner.py, connector.py, scheduler.py, engine.py): a chat's
segments are its whole prompt's tokens, and a message cut by the separator gives chunks whose tokens are the pieces'
(each the same wherever it stands), the tokens the model is fed; a prefill in pieces and cached decode equal a full
forward, and a batch gives each item what it gets alone; blending at ratio 1 is a full prefill and at ratio 0 full
reuse; a repeat and a reordered request sent the moment the first one ends are served from the store; a new chat
behind a stored system message starts past it; batched answers equal serial ones; the store holds only exact KV;
store jobs finish under steady traffic; a stalled tier delays no step; documents cut by the separator in one message
come back blended in another order; penalties and logit_bias follow OpenAI's formula, logprobs are the log_softmax of
the logits a token was picked from, echo scores each prompt token by a full prefill's logits before it, a tiny top_p
is greedy."""
import threading
import time

import numpy as np
import pytest
import torch

from common.gguf_llama import gguf_file
from common.llama import Llama, LlamaConfig, kv_to_array
from lecture27 import kvstore as ks
from lecture27.engine import runner
from lecture27.engine.chat import SEPARATOR, chat_prompt, completion_prompt
from lecture27.engine.connector import BLOCK_TOKENS, HotCache, KVConnector, Tiers, block_keys, message_keys
from lecture27.engine.engine import Engine
from lecture27.engine.blocks import SeqCache, array_to_block, block_to_array
from lecture27.engine.runner import Item
from lecture27.engine.sequence import Request, Sequence, pick

DOCS = ["Lake Varna lies in a narrow valley carved by glaciers. Its deepest point is 212 metres below the surface.",
        "Lake Osric is wide and popular with sailors. Surveys with sonar measured its greatest depth at 147 metres.",
        "The valley that holds Lake Varna is also home to three small villages and a ski lift that runs in winter."]
QUESTION = "Which lake is deeper, Lake Varna or Lake Osric?"


def chat(order=(0, 1, 2), system="Answer from the documents.", question=QUESTION) -> list:
    return [("system", system)] + [("user", DOCS[i]) for i in order] + [("user", question)]


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal up to float32 rounding of sums taken in another order: logits of scale S agree to ~1e-4 S."""
    return float((a - b).abs().max()) <= 2e-4 * float(b.abs().max()) + 1e-4


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    return Llama(LlamaConfig(vocab_size=97)).eval()


@pytest.fixture(scope="module")
def parts(smollm2):
    model, tok, _ = smollm2
    return model, tok, ks.model_id(gguf_file(None))


def connector(parts, tiers=None, **kw) -> KVConnector:
    model, _, mid = parts
    tiers = tiers if tiers is not None else Tiers([ks.RamTier(1 << 30)], ks.kv_shape(model.cfg))
    return KVConnector(mid, tiers, model.cfg.n_kv_heads, **kw)


def engine(parts, con=None, threads=1, **kw) -> Engine:
    model, tok, _ = parts
    con = con if con is not None else connector(parts)
    ends = {tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")}
    return Engine(model, tok, con, ends, threads=threads, **kw).start()


class Answer:
    """A request's events, collected from the model thread."""

    def __init__(self, eng: Engine, prompt, then=None, **kw):
        self.events, self.done, self.times, self.then = [], threading.Event(), [], then
        eng.submit(Request(prompt=prompt, emit=self.emit, **kw))

    def emit(self, kind, **data):
        self.events.append((kind, data))
        self.times.append((kind, time.perf_counter()))
        if kind == "end" and self.then:
            self.then()
        if kind in ("end", "error"):
            self.done.set()

    def wait(self, timeout=60) -> "Answer":
        assert self.done.wait(timeout), self.events
        assert self.events[-1][0] == "end", self.events[-1]
        return self

    @property
    def text(self) -> str:
        return "".join(d["delta"] for k, d in self.events if k == "text")

    @property
    def reuse(self):
        return next(d["reuse"] for k, d in self.events if k == "start")

    @property
    def end(self) -> dict:
        return self.events[-1][1]


def settle(eng: Engine, timeout=120) -> None:
    """Until the engine has no store job left and every write is done."""
    deadline = time.monotonic() + timeout
    while eng.load()["store_jobs"] or eng.load()["queued"] or eng.load()["running"]:
        assert time.monotonic() < deadline and eng.model_thread.is_alive()
        time.sleep(0.02)


# ------------------------------------------------------------------------------------------------ the runner
def test_a_prefill_in_pieces_and_cached_decode_equal_a_full_forward(tiny_model):
    model = tiny_model
    tokens = torch.randint(0, 97, (40,)).tolist()
    cache = SeqCache.empty(model.cfg, 2)   # little room: the buffer must grow
    for a in range(0, 33, 11):
        lg = runner.run(model, [Item(tokens[a:min(a + 11, 33)], cache, True)])[0]
    for t in range(33, 40):
        with torch.no_grad():
            full = model(torch.tensor([tokens[:t]]))[0][0, -1]
        assert close(lg, full), t
        lg = runner.run(model, [Item([tokens[t]], cache, True)])[0]
    with torch.no_grad():
        want = kv_to_array(model(torch.tensor([tokens]))[1])[0]
    assert len(cache) == 40 and np.abs(kv_to_array(cache.kvcache())[0] - want).max() <= 1e-5


def test_packed_weights_give_the_models_numbers_and_leave_the_model_as_it_is(tiny_model):
    model, tokens = tiny_model, torch.randint(0, 97, (1, 30))
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN to pack weights for")
    fast = runner.packed(model)
    assert isinstance(fast.layers[3].w_up, runner.PackedLinear) and isinstance(fast.head, runner.PackedLinear)
    assert isinstance(model.layers[3].w_up, torch.nn.Linear) and model.head is None   # the model is not touched
    with torch.no_grad():
        (want, want_kv), (got, got_kv) = model(tokens), fast(tokens)
    assert close(got, want) and np.abs(kv_to_array(got_kv) - kv_to_array(want_kv)).max() <= 1e-5
    cache = SeqCache.empty(model.cfg, 30)
    assert close(runner.run(fast, [Item(tokens[0].tolist(), cache, True)])[0], want[0, -1])


def test_a_batch_gives_each_item_what_it_gets_alone(tiny_model):
    model, rng = tiny_model, torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 97, (n,), generator=rng).tolist() for n in (1, 9, 30)]
    behind = torch.randint(0, 97, (12,), generator=rng).tolist()

    def caches():
        with torch.no_grad():
            held = SeqCache.of(model(torch.tensor([behind]))[1], 40)
        return [SeqCache.empty(model.cfg, 40), SeqCache.empty(model.cfg, 40), held]
    alone = [runner.run(model, [Item(p, c, True)])[0] for p, c in zip(prompts, caches())]
    together_caches = caches()
    items = [Item(p, c, i != 1) for i, (p, c) in enumerate(zip(prompts, together_caches))]
    together = runner.run(model, items)
    assert together[1] is None
    for i in (0, 2):
        assert close(together[i], alone[i])
    with torch.no_grad():
        want = model(torch.tensor([behind + prompts[2]]))[0][0, -1]
    assert close(together[2], want)   # the third item attended to its own cache, not to the others'
    assert [len(c) for c in together_caches] == [1, 9, 42]


def test_attention_in_row_groups_equals_one_call_and_reads_fewer_keys():
    g = torch.Generator().manual_seed(2)
    F = torch.nn.functional
    M, S, n = 150, 200, 50
    q, k, v = torch.randn(1, 4, M, 16, generator=g), torch.randn(1, 2, S, 16, generator=g), \
        torch.randn(1, 2, S, 16, generator=g)
    causal = torch.arange(S)[None, :] <= torch.arange(n, n + M)[:, None]   # a prefill's rows behind 50 cached tokens
    rows = torch.randperm(S - 10, generator=g)[:M].sort().values            # CacheBlend's recomputed rows, in order
    blended = (torch.arange(S)[None, None, :] <= rows[None, :, None])[:, None]
    chunked = (torch.arange(S)[None, :] // 40 == torch.arange(M)[:, None] // 30) & causal   # no prefix of the keys
    for mask in (causal, blended, chunked):
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        assert (runner.attend(q, k, v, mask) - want).abs().max() <= 1e-5
    assert runner.row_groups(causal) == [(0, 64, 114), (64, 128, 178), (128, 150, 200)]
    later = torch.arange(S)[None, :] >= torch.arange(M)[:, None]   # each row sees the keys from its own on
    additive = torch.zeros(M, S).masked_fill(~later, float("-inf"))   # the same mask as SDPA adds it
    assert (runner.attend(q, k, v, additive) - runner.attend(q, k, v, later)).abs().max() <= 1e-5


def test_a_step_asking_no_logits_still_fills_the_last_layers_cache(tiny_model):
    """Prompts longer than a row group; the last layer runs only the asked rows past their K, V."""
    model, rng = tiny_model, torch.Generator().manual_seed(3)
    a, b = (torch.randint(0, 97, (n,), generator=rng).tolist() for n in (150, 90))
    ca, cb = SeqCache.empty(model.cfg, 100), SeqCache.empty(model.cfg, 1)
    assert runner.run(model, [Item(a[:120], ca, False)]) == [None]
    got = runner.run(model, [Item(a[120:], ca, True), Item(b, cb, False), Item([a[0]], SeqCache.empty(model.cfg, 1),
                                                                             True)])
    assert got[1] is None
    with torch.no_grad():
        (want_a, kv_a), (_, kv_b) = model(torch.tensor([a])), model(torch.tensor([b]))
        want_0 = model(torch.tensor([a[:1]]))[0][0, -1]
    assert close(got[0], want_a[0, -1]) and close(got[2], want_0)
    for cache, kv in ((ca, kv_a), (cb, kv_b)):
        assert np.abs(kv_to_array(cache.kvcache())[0] - kv_to_array(kv)[0]).max() <= 1e-5


def test_an_item_asking_every_tokens_logits_gets_the_full_forwards_beside_the_others(tiny_model):
    """Echo's pieces run in the step's batch (Item.every): a piece of 80 tokens (more than a row group) behind 70
    already run gets every position's logits, each equal to a full forward's, while a decode and a prefill run
    beside it."""
    model, rng = tiny_model, torch.Generator().manual_seed(4)
    a, b = (torch.randint(0, 97, (n,), generator=rng).tolist() for n in (150, 20))
    ca = SeqCache.empty(model.cfg, 10)
    first = runner.run(model, [Item(a[:70], ca, False, every=True)])[0]
    got = runner.run(model, [Item([b[0]], SeqCache.empty(model.cfg, 1), True),
                             Item(a[70:], ca, False, every=True), Item(b, SeqCache.empty(model.cfg, 1), True)])
    with torch.no_grad():
        want = model(torch.tensor([a]))[0][0]
    assert first.shape == (70, 97) and got[1].shape == (80, 97)
    assert close(torch.cat([first, got[1]]), want)
    with torch.no_grad():
        alone = model(torch.tensor([b[:1]]))[0][0, -1], model(torch.tensor([b]))[0][0, -1]
    assert close(got[0], alone[0]) and close(got[2], alone[1])


def test_the_hot_cache_keeps_its_byte_budget_least_recently_used_out():
    block = torch.zeros(2, 2, 1, 4, 8)   # 512 bytes
    hot = HotCache(3 * block.numel() * 4)
    keys = [ks.ChunkKey("m", (i,)) for i in range(4)]
    for k in keys[:3]:
        assert hot.put(k, block)
    hot.get(keys[0])                   # keys[0] is now the most recent: keys[1] goes first
    hot.put(keys[3], block)
    assert not hot.has(keys[1]) and all(hot.has(k) for k in (keys[0], keys[2], keys[3]))
    assert hot.used == 3 * 512 and hot.evictions == 1
    assert not hot.put(ks.ChunkKey("m", (9,)), torch.zeros(4, 2, 1, 8, 8))   # bigger than the budget


# ------------------------------------------------------------------------------------------------ the chat
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


# ------------------------------------------------------------------------------------------------ CacheBlend
@pytest.mark.parametrize("form", ["messages", "one message"])
def test_blend_at_ratio_1_is_a_full_prefill_and_at_ratio_0_full_reuse(parts, form):
    """Documents as messages, and in one message at the separator (the header, each piece with the separator, the
    question after the last one): either way the chunks, their places and the question make a full prefill at
    ratio 1, so what the one-message form loses at ratio 0 is in its stored chunks, not in how they are put back."""
    model, tok, mid = parts
    p = chat_prompt(tok, chat((2, 0, 1)) if form == "messages" else cut((2, 0, 1)))
    keys = ks.chunk_keys(mid, p.system, p.chunks)
    blocks = [array_to_block(X, model.cfg.n_kv_heads) for X in ks.chunk_kvs(model, p.system, p.chunks)]
    rule = connector(parts).rule
    with torch.no_grad():
        full = model(torch.tensor([p.tokens]), last=True)[0][0, -1]
        pre = ks.assemble(keys, ks.chunk_kvs(model, p.system, p.chunks), model.cfg)
        reuse = model(torch.tensor([list(p.question)]), cache=pre, last=True)[0][0, -1]
    one, cache = runner.blend(model, p.system, list(p.chunks), p.question, keys, blocks, 1.0, rule, 4)
    zero, _ = runner.blend(model, p.system, list(p.chunks), p.question, keys, blocks, 0.0, rule, 4)
    assert close(one, full) and close(zero, reuse) and not close(zero, full)
    assert len(cache) == len(p) and cache.buf.shape[3] >= len(p) + 4


# ------------------------------------------------------------------------------------------------ the engine
def test_a_repeat_sent_at_once_is_served_from_the_store_exactly(parts):
    """The second request is submitted in the first one's "end" event: the first one's blocks are in the hot cache
    by then (no I/O, no wait for a writer), and its prefix is all but the last token. Both first-token KLs against
    a full prefill are float32 rounding (below 1e-4 nats)."""
    model, tok, _ = parts
    eng = engine(parts)
    p = chat_prompt(tok, chat())
    try:
        second = {}
        first = Answer(eng, p, then=lambda: second.setdefault("a", Answer(eng, p, max_tokens=6, kv_check=True)),
                       max_tokens=6, kv_check=True).wait()
        again = second["a"].wait()
    finally:
        eng.stop()
    assert first.reuse.path == "prefill" and first.reuse.recomputed == len(p)
    assert again.reuse.path == "prefix" and again.reuse.prefix == len(p) - 1 and again.reuse.recomputed == 1
    assert again.reuse.hits == {"hot": -(-(len(p) - 1) // BLOCK_TOKENS)}
    assert again.text == first.text
    assert abs(again.end["kl"]) < 1e-4 and abs(first.end["kl"]) < 1e-4


def test_a_new_chat_behind_a_stored_system_message_reuses_it_exactly(parts):
    """A system message shorter than a prefix block is stored alone, at the prompt's start: the next chat with the
    same system message and a new question (no prefix block in common) prefills only past it, and its answer and
    first token are a full prefill's (the KL is float32 rounding)."""
    model, tok, _ = parts
    eng = engine(parts)
    try:
        first = Answer(eng, chat_prompt(tok, chat((0,))), max_tokens=4).wait()
        settle(eng)
        p = chat_prompt(tok, chat((1,), question="How deep is Lake Osric?"))
        again = Answer(eng, p, max_tokens=6, kv_check=True).wait()
    finally:
        eng.stop()
    alone = engine(parts, connector(parts, store=False))
    try:
        reference = Answer(alone, p, max_tokens=6).wait()
    finally:
        alone.stop()
    S = len(p.system)
    assert first.reuse.path == "prefill" and S < BLOCK_TOKENS
    assert again.reuse.path == "prefix" and again.reuse.prefix == S and again.reuse.recomputed == len(p) - S
    assert again.reuse.hits == {"hot": 1}
    assert again.text == reference.text and abs(again.end["kl"]) < 1e-4


def test_a_reordered_request_sent_at_once_is_blended_from_the_store(parts):
    """The documents' chunks are store jobs from the moment the first request starts: a reordered request sent the
    moment it ends finds every document's chunk (none computed again), and the system message's exact KV."""
    model, tok, _ = parts
    eng = engine(parts)
    try:
        moved, second = chat_prompt(tok, chat((2, 0, 1))), {}
        first = Answer(eng, chat_prompt(tok, chat()), max_tokens=8,
                       then=lambda: second.setdefault("a", Answer(eng, moved, max_tokens=4, kv_check=True))).wait()
        again = second["a"].wait()
    finally:
        eng.stop()
    assert first.reuse.path == "prefill"
    r = again.reuse
    assert r.path == "blend" and r.blended == sum(map(len, moved.chunks)) and r.prefix == len(moved.system)
    assert r.recomputed == len(moved.question) and 0 < again.end["kl"] < 0.5


def test_a_blended_prompts_cached_tokens_count_only_the_chunks_the_store_held(parts):
    """Two documents stored, then three in another order: the new one is computed in this request, so the usage's
    cached tokens (Reuse.cached) are the system message's and the two stored documents', and the new document's
    tokens count as recomputed with the question's."""
    model, tok, _ = parts
    eng = engine(parts)
    try:
        Answer(eng, chat_prompt(tok, chat((0, 1))), max_tokens=2).wait()
        settle(eng)
        moved = chat_prompt(tok, chat((1, 2, 0)))
        r = Answer(eng, moved, max_tokens=2).wait().reuse
    finally:
        eng.stop()
    stored = len(moved.chunks[0]) + len(moved.chunks[2])
    assert r.path == "blend" and r.prefix == len(moved.system) and r.blended == stored
    assert r.cached == len(moved.system) + stored and r.recomputed == len(moved.chunks[1]) + len(moved.question)


def test_the_store_holds_only_exact_kv(parts):
    """After a blended request, every prefix block and message chunk the store holds (hot and the RAM tier) is what
    a full prefill (of the prefix, of the message behind the system message) computes: blended rows never are."""
    model, tok, mid = parts
    con = connector(parts)
    eng = engine(parts, con)
    try:
        Answer(eng, chat_prompt(tok, chat()), max_tokens=2).wait()
        settle(eng)
        moved = chat_prompt(tok, chat((1, 2, 0)))
        done = Answer(eng, moved, max_tokens=2).wait()
        settle(eng)
    finally:
        eng.stop()
    assert done.reuse.path == "blend"
    with torch.no_grad():
        exact = kv_to_array(model(torch.tensor([moved.tokens]))[1])[0]
    S = len(moved.system)

    def stored(key):
        hot, (ram, _) = con.hot.get(key), con.tiers.get(key)
        assert (hot is None) == (ram is None), key
        return None if hot is None else (block_to_array(hot), ram)
    for a, b, key in block_keys(mid, moved.tokens):
        got = stored(key)
        if b > S:   # past the system message the request's KV was blended: none of it is a prefix block
            assert got is None, (a, b)
        elif got is not None:
            for X in got:
                assert np.abs(X - exact[a:b]).max() <= 1e-3 * np.abs(exact[a:b]).max(), (a, b)
    for key, chunk in zip(message_keys(mid, moved), (*moved.chunks, moved.last_message)):
        want = ks.chunk_kvs(model, moved.system, [chunk])[-1]
        for X in stored(key):
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


def test_decoding_stops_at_max_tokens_a_stop_string_and_the_end_of_turn(parts):
    model, tok, _ = parts
    con = connector(parts, store=False)
    eng = engine(parts, con)
    try:
        p = completion_prompt(tok, "The days of the week are Monday, Tuesday,")
        a = Answer(eng, p, max_tokens=6, temperature=0).wait()
        assert a.events[0][0] == "start" and a.end == {"finish_reason": "length", "tokens": 6, "kl": None}
        with torch.no_grad():   # the same greedy tokens as decoding by hand with the cache
            logits, cache = model(torch.tensor([p.tokens]), last=True)
            ids = []
            for _ in range(6):
                ids.append(int(logits[0, -1].argmax()))
                logits, cache = model(torch.tensor([[ids[-1]]]), cache=cache, last=True)
        assert a.text == tok.decode(ids)
        stop = a.text.split()[1]   # a word the answer holds: the text ends before it
        cut = Answer(eng, p, max_tokens=6, temperature=0, stop=(stop,)).wait()
        assert cut.text == a.text[:a.text.index(stop)] and cut.end["finish_reason"] == "stop"
        s1 = Answer(eng, p, max_tokens=5, temperature=0.8, seed=7).wait()
        s2 = Answer(eng, p, max_tokens=5, temperature=0.8, seed=7).wait()
        assert s1.text == s2.text   # a seed makes sampling repeat
    finally:
        eng.stop()
    ended = Engine(model, tok, con, {ids[2]}, threads=1).start()   # the third token ends the answer, as an end of turn
    try:
        e = Answer(ended, p, max_tokens=6, temperature=0).wait()
        assert e.end["finish_reason"] == "stop" and e.end["tokens"] == 2 and e.text == tok.decode(ids[:2])
        on = Answer(ended, p, max_tokens=6, temperature=0, ignore_eos=True).wait()   # vLLM's field: past it
        assert on.end["finish_reason"] == "length" and on.end["tokens"] == 6
    finally:
        ended.stop()


ASKS = [("completion", "The days of the week are Monday, Tuesday,", 12, ()),
        ("chat", "Write the number 7 in words, then stop.", 9, ()),
        ("chat", "Name three colours of the rainbow.", 16, (",",)),
        ("completion", "One, two, three, four,", 20, (" seven",)),
        ("chat", DOCS[0] + " " + DOCS[1] + " " + QUESTION, 7, ()),
        ("completion", "def fibonacci(n):", 14, ("\n\n",)),
        ("chat", "Hi!", 5, ()),
        ("chat", DOCS[2] + " What runs in winter?", 11, (".",))]


def _ask(eng, tok, kind, text, max_tokens, stop):
    p = completion_prompt(tok, text) if kind == "completion" else chat_prompt(tok, [("user", text)])
    return Answer(eng, p, max_tokens=max_tokens, temperature=0, stop=stop)


def test_batched_answers_equal_serial_ones(parts):
    """8 requests of different lengths, stop strings and max_tokens sent at once (batched: prefilled in pieces
    beside each other's decodes) get, token for token, the answers they get one at a time."""
    model, tok, _ = parts
    serial = engine(parts, connector(parts, store=False), max_running=1)
    try:
        alone = [_ask(serial, tok, *a).wait() for a in ASKS]
    finally:
        serial.stop()
    batched = engine(parts, connector(parts, store=False), step_tokens=48)   # small steps: prompts in pieces
    try:
        together = [_ask(batched, tok, *a) for a in ASKS]
        together = [t.wait() for t in together]
        assert batched.steps < sum(a.end["tokens"] for a in alone)   # they ran side by side
    finally:
        batched.stop()
    assert [t.text for t in together] == [a.text for a in alone]
    assert [t.end for t in together] == [a.end for a in alone]


def test_store_jobs_finish_under_steady_traffic(parts):
    """A document seen once is stored (prefilled alone, at low priority) while other requests keep the engine busy:
    it is held before they end."""
    model, tok, mid = parts
    con = connector(parts)
    eng = engine(parts, con, step_tokens=64, store_job_tokens=16)
    try:
        busy = [_ask(eng, tok, "completion", f"Count from {n} to one hundred:", 40, ()) for n in (1, 2)]
        p = chat_prompt(tok, chat())
        Answer(eng, p, max_tokens=1).wait()
        keys = message_keys(mid, p)[1:]
        deadline = time.monotonic() + 120
        while not all(con.hot.has(k) for k in keys):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert not any(b.done.is_set() for b in busy)
        for b in busy:
            b.wait()
    finally:
        eng.stop()


class _WatchedTier(ks.RamTier):
    """A RAM tier that calls `_watch()` at each look-up and write, before doing it."""

    def __init__(self):
        super().__init__(1 << 30)

    def _watch(self):
        pass

    def put(self, name, blob):
        self._watch()
        return super().put(name, blob)

    def has(self, name):
        self._watch()
        return super().has(name)


class _StalledTier(_WatchedTier):
    """A tier whose reads and writes hang while `stalled` is set (a Redis server under SIGSTOP)."""
    name = "stalled"

    def __init__(self):
        super().__init__()
        self.stalled = threading.Event()

    def _watch(self):
        while self.stalled.is_set():
            time.sleep(0.01)


def test_a_stalled_tier_delays_no_step(parts):
    """While a tier hangs, the four requests decoding go on at their pace: their writes and the next request's
    lookup wait for it, the steps do not."""
    model, tok, _ = parts
    stalled = _StalledTier()
    con = connector(parts, Tiers([ks.RamTier(1 << 30), stalled], ks.kv_shape(model.cfg)))
    eng, short = engine(parts, con), None
    try:
        Answer(eng, completion_prompt(tok, "Warm up."), max_tokens=2).wait()
        settle(eng)
        runs = [_ask(eng, tok, *a) for a in ASKS[:4]]
        while not all(any(k == "text" for k, _ in r.events) for r in runs):
            time.sleep(0.01)
        stalled.stalled.set()
        steps, since = eng.steps, time.perf_counter()
        runs[0].wait(30)       # its KV is saved: hot at once, the stalled tier's write hangs in the writer
        short = _ask(eng, tok, "chat", "Hi!", 3, ())   # its lookup hangs in the loader, behind the tier
        for r in runs[1:]:
            r.wait(30)
        assert eng.steps > steps and eng.load()["store_jobs"] > 0 and not short.done.is_set()
        gaps = [b - a for r in runs for (k1, a), (k2, b) in zip(r.times, r.times[1:])
                if k1 == k2 == "text" and a > since]
        assert gaps and max(gaps) < 2.0
    finally:
        stalled.stalled.clear()
        if short is not None:
            short.wait()
        eng.stop()


class _ThreadsTier(_WatchedTier):
    """A RAM tier that notes, at each look-up and write, the thread it runs in and that thread's torch threads."""
    name = "threads"

    def __init__(self):
        super().__init__()
        self.seen = []

    def _watch(self):
        self.seen.append((threading.current_thread().name, torch.get_num_threads()))


def test_only_the_model_thread_runs_torch_on_several_cores(parts):
    """The writer (a record written behind) and the loader (a look-up) run torch on one thread, the model thread on
    the engine's count, even where the thread that built them runs on two (engine.py's docstring: a second OpenMP
    team puts the model thread's workers to sleep after every parallel region). The writer is asked first, alone: a
    thread's count starts as the last one any thread set, so the loader's setting would hide the writer's."""
    model, tok, mid = parts
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    tier, eng, model_threads = _ThreadsTier(), None, []
    con = connector(parts, Tiers([tier], ks.kv_shape(model.cfg)))
    try:
        cfg = model.cfg
        con.save(ks.ChunkKey(mid, tuple(range(8))), torch.zeros(cfg.n_layers, 2, cfg.n_kv_heads, 8, cfg.head_dim))
        deadline = time.monotonic() + 30
        while con.pending_writes and time.monotonic() < deadline:
            time.sleep(0.01)
        writer = list(tier.seen)
        eng = engine(parts, con, threads=2)
        Answer(eng, chat_prompt(tok, [("user", "Name a colour.")]), max_tokens=2).wait()
        settle(eng)
        eng.inbox.put(lambda: model_threads.append(torch.get_num_threads()))
        while not model_threads and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        if eng is not None:
            eng.stop()
        torch.set_num_threads(before)
    assert writer and {name for name, _ in writer} == {"engine-writer"} and all(n == 1 for _, n in writer), writer
    assert {name for name, _ in tier.seen} == {"engine-loader", "engine-writer"}
    assert all(n == 1 for _, n in tier.seen), tier.seen
    assert model_threads == [2]


# ------------------------------------------------------------------------------------------------ the separator
DOCS6 = DOCS + ["Lake Osric freezes over every January, and the ice is thick enough to walk on by February.",
                "A ferry crosses Lake Varna twice a day in summer; it does not run when the wind is strong.",
                "The oldest map of the region, drawn in 1820, shows Lake Osric under another name, Lake Ossery."]


def cut(order, question=QUESTION) -> list:
    """One user message: the documents in this order and the question, the separator between them."""
    return [("system", "Answer from the documents."), ("user", SEPARATOR.join([DOCS6[i] for i in order] + [question]))]


def test_a_separator_cuts_a_message_into_chunks_whose_tokens_are_the_prompts(parts):
    """Tokenized piecewise: the header, each piece (after the separator's space) with the separator's tokens, the
    tail; the segments concatenated are the tokens the engine feeds the model, they are the whole text's tokens (one
    space given to the message's first piece), and a document's chunk is the same in another order and in another
    message."""
    _, tok, _ = parts
    enc = lambda text: tuple(tok.encode(text).ids)   # noqa: E731
    sep, doc = enc(SEPARATOR.rstrip()), lambda i: enc(" " + DOCS6[i]) + enc(SEPARATOR.rstrip())   # noqa: E731
    order = (3, 0, 5, 1)
    p = chat_prompt(tok, cut(order))
    want = [*enc("<|im_start|>system\nAnswer from the documents.<|im_end|>\n"), *enc("<|im_start|>user\n")]
    for i in order:
        want += doc(i)
    want += [*enc(" " + QUESTION + "<|im_end|>\n"), *enc("<|im_start|>assistant\n")]
    assert p.tokens == want and len(p) == len(want)
    assert [*p.system, *(t for c in p.chunks for t in c), *p.question] == p.tokens
    text = "<|im_start|>system\nAnswer from the documents.<|im_end|>\n<|im_start|>user\n" + \
        SEPARATOR.join([DOCS6[i] for i in order] + [QUESTION]) + "<|im_end|>\n<|im_start|>assistant\n"
    fed = text.replace("<|im_start|>user\n", "<|im_start|>user\n ")   # the first piece's space
    assert p.tokens == list(enc(fed)) and tok.decode(p.tokens, skip_special_tokens=False) == fed
    assert p.chunks[0] == enc("<|im_start|>user\n") and p.chunks[1:] == tuple(doc(i) for i in order)
    assert p.last_message == enc(" " + QUESTION + "<|im_end|>\n") and p.question[:len(p.last_message)] == p.last_message
    moved = chat_prompt(tok, cut((1, 5, 3)))
    assert set(moved.chunks[1:]) <= set(p.chunks[1:])
    # in an earlier message, beside a message without the separator (kept whole, as before)
    turn = chat_prompt(tok, [("user", "Hi!"), ("user", SEPARATOR.join([DOCS6[3], DOCS6[1], "tail"])), ("user", "ok?")])
    assert turn.chunks[0] == enc("<|im_start|>user\nHi!<|im_end|>\n")
    assert turn.chunks[2:4] == (doc(3), doc(1)) and turn.chunks[4] == enc(" tail<|im_end|>\n")
    # two separators in a row: a chunk of the separator alone; no separator: the message is one chunk, as before
    empty = chat_prompt(tok, [("user", DOCS6[0] + SEPARATOR + SEPARATOR + QUESTION)])
    assert empty.chunks[1:] == (doc(0), sep)
    for off in (None, ""):
        whole = chat_prompt(tok, cut(order), separator=off)
        assert whole.chunks == () and whole.tokens == list(enc(text))
    text = SEPARATOR.join(["Documents:", DOCS6[2], DOCS6[4], "Q:"])
    c = completion_prompt(tok, text)   # a completion's tokens are its whole text's
    assert c.system == enc("Documents:") + sep and c.chunks == (doc(2), doc(4)) and c.tokens == list(enc(text))
    assert c.question == enc(" Q:") and c.last_message == ()


def test_the_model_is_fed_the_segments_tokens(parts):
    """No store: the greedy answer to a cut prompt is the one decoded by hand from its segments' tokens."""
    model, tok, _ = parts
    eng = engine(parts, connector(parts, store=False))
    p = chat_prompt(tok, cut((2, 0)))
    try:
        a = Answer(eng, p, max_tokens=3, temperature=0).wait()
    finally:
        eng.stop()
    with torch.no_grad():
        logits, cache = model(torch.tensor([p.tokens]), last=True)
        ids = []
        for _ in range(3):
            ids.append(int(logits[0, -1].argmax()))
            logits, cache = model(torch.tensor([[ids[-1]]]), cache=cache, last=True)
    assert a.text == tok.decode(ids)


def test_documents_cut_by_the_separator_come_back_blended_in_another_order(parts):
    """Six documents in one user message, then the same in another order, sent the moment the first ends: every
    document's chunk comes from the store (the header too), the question is computed, the first token's KL small."""
    model, tok, _ = parts
    eng = engine(parts)
    try:
        moved, second = chat_prompt(tok, cut((4, 2, 0, 5, 1, 3))), {}
        first = Answer(eng, chat_prompt(tok, cut(range(6))), max_tokens=8,
                       then=lambda: second.setdefault("a", Answer(eng, moved, max_tokens=4, kv_check=True))).wait()
        again = second["a"].wait()
    finally:
        eng.stop()
    assert first.reuse.path == "prefill"
    r, docs = again.reuse, sum(map(len, moved.chunks[1:]))
    assert r.path == "blend" and r.blended == sum(map(len, moved.chunks)) >= docs and r.prefix == len(moved.system)
    assert r.recomputed == len(moved.question) and 0 <= again.end["kl"] < 0.5, again.end


# ------------------------------------------------------------------------------------------------ decoding
def test_penalties_and_logit_bias_follow_openais_formula(parts):
    """logits[t] += bias[t]; then -= presence * [count > 0] + frequency * count over the answer's tokens so far."""
    model, tok, _ = parts
    p = completion_prompt(tok, "One, two")
    seq = Sequence(Request(prompt=p, emit=print, presence_penalty=0.5, frequency_penalty=0.25,
                           logit_bias={7: 3.0, 9: -100.0}), model.cfg)
    for t in (5, 5, 5, 7):
        seq.chose(t)
    logits = torch.linspace(-1, 1, 12)
    got = seq.shaped(logits)
    want = logits.clone()
    want[7] += 3.0
    want[9] -= 100.0
    want[5] -= 0.5 + 0.25 * 3
    want[7] -= 0.5 + 0.25 * 1
    assert torch.allclose(got, want) and torch.equal(logits, torch.linspace(-1, 1, 12))   # the served ones untouched
    plain = Sequence(Request(prompt=p, emit=print), model.cfg)
    plain.chose(5)
    assert plain.shaped(logits) is logits


def test_a_tiny_top_p_is_greedy_and_a_seed_repeats_the_draw():
    logits = torch.tensor([0.0, 2.0, 1.9, -1.0])
    for seed in range(20):
        assert pick(logits, 1.5, torch.Generator().manual_seed(seed), top_p=1e-6) == 1
    kept = {pick(logits, 1.5, torch.Generator().manual_seed(s), top_p=0.6) for s in range(200)}
    assert kept == {1, 2}   # the nucleus: the two most likely tokens hold more than 0.6, the first alone less
    draws = [[pick(logits, 1.0, g, 0.9) for _ in range(10)] for g in
             (torch.Generator().manual_seed(3), torch.Generator().manual_seed(3))]
    assert draws[0] == draws[1]


def test_logprobs_are_the_served_logits_and_echo_scores_every_prompt_token(parts):
    """Greedy answer tokens are each the top logprob of the logits they were picked from (a hand decode's); echo's
    prompt scores are a full forward's log_softmax at the position before each token, across the echo's pieces."""
    model, tok, _ = parts
    eng = engine(parts, connector(parts, store=False), step_tokens=16)   # the prompt scored in several pieces
    p = completion_prompt(tok, "The days of the week are Monday, Tuesday, Wednesday, and then")
    try:
        a = Answer(eng, p, max_tokens=4, temperature=0, logprobs=2, echo_logprobs=2, kv_check=True).wait()
    finally:
        eng.stop()
    kinds = [k for k, _ in a.events]
    assert kinds.index("start") < kinds.index("prompt") < kinds.index("end")
    scores = [d["scored"] for k, d in a.events if k == "text" and d["token"] is not None]
    with torch.no_grad():
        full = model(torch.tensor([p.tokens]))[0][0].log_softmax(-1)
        logits, cache = model(torch.tensor([p.tokens]), last=True)
        for s in scores:
            lp = logits[0, -1].log_softmax(-1)
            assert s.top[0][0] == s.token == int(lp.argmax()) and len(s.top) == 2
            assert abs(s.logprob - float(lp[s.token])) < 1e-3 and s.logprob <= 0
            logits, cache = model(torch.tensor([[s.token]]), cache=cache, last=True)
    prompt = next(d["scores"] for k, d in a.events if k == "prompt")
    assert len(prompt) == len(p) and prompt[0] is None
    for i, s in enumerate(prompt[1:], 1):
        assert s.token == p.tokens[i] and abs(s.logprob - float(full[i - 1, s.token])) < 1e-3, i
        assert [t for t, _ in s.top] == full[i - 1].topk(2).indices.tolist()
    assert abs(a.end["kl"]) < 1e-4   # the echo's last logits are the full prefill's
