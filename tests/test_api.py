"""serve.py's OpenAI API as real clients use it: the official openai SDK, sync (OpenAI) and async (AsyncOpenAI),
streaming and not, over every field the engine honours (logprobs, top_logprobs, echo, presence and frequency
penalties, logit_bias, top_p, seed, stop) or refuses (a 400 naming the field), an unknown model (404,
openai.NotFoundError), /v1/models, usage counted alike on every path; documents cut by the separator in one user
message (or a completion's text), sent again in another order, served from the store; bad input (a separator
inside a word, two separators in a row, 150 chunks, a chunk longer than the context) answered or refused cleanly
while the server serves on."""
import asyncio
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from lecture27.serving import bench, launch
from lecture27.engine.chat import SEPARATOR
from lecture27.serving.served import parse_kv

pytestmark = [pytest.mark.filterwarnings("ignore::ResourceWarning"), pytest.mark.slow, pytest.mark.server,
              pytest.mark.real_model]
USER = [{"role": "user", "content": "Name three colours of the rainbow."}]
DOCS = ["Lake Varna lies in a narrow valley carved by glaciers. Its deepest point is 212 metres below the surface.",
        "Lake Osric is wide and popular with sailors. Surveys with sonar measured its greatest depth at 147 metres.",
        "The valley that holds Lake Varna is also home to three small villages and a ski lift that runs in winter.",
        "Lake Osric freezes over every January, and the ice is thick enough to walk on by February.",
        "A ferry crosses Lake Varna twice a day in summer; it does not run when the wind is strong.",
        "The oldest map of the region, drawn in 1820, shows Lake Osric under another name, Lake Ossery."]
QUESTION = "Which lake is deeper, Lake Varna or Lake Osric?"


@pytest.fixture(scope="module")
def server():
    from common.gguf_llama import find_smollm2_gguf
    if find_smollm2_gguf() is None:
        pytest.skip("SmolLM2 is not installed")
    s = launch.engine("--no-redis").start()
    yield s
    s.stop()


def sync(s):
    return bench.client_for(s.url)


def aio(s):
    return openai.AsyncOpenAI(base_url=s.url, api_key="none", max_retries=0, timeout=600)


def chat(s, **kw):
    kw = {"model": s.model, "messages": USER, "max_tokens": 8, "temperature": 0, **kw}
    return sync(s).chat.completions.create(**kw)


def complete(s, **kw):
    kw = {"model": s.model, "max_tokens": 6, "temperature": 0, **kw}
    return sync(s).completions.create(**kw)


def metric(server, name: str) -> float:
    with urllib.request.urlopen(server.url.removesuffix("/v1") + "/metrics") as r:
        text = r.read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")
               or line.startswith(name + "{"))


# ------------------------------------------------------------------------------------------------ the model
def test_models_carry_root_and_max_model_len(server):
    m = sync(server).models.list().data[0]
    assert m.id == server.model and m.root.endswith(".gguf") and m.max_model_len == 8192


def test_an_unknown_model_raises_not_found_sync_and_async(server):
    with pytest.raises(openai.NotFoundError) as e:
        sync(server).chat.completions.create(model="gpt-4o", messages=USER)
    assert e.value.status_code == 404 and e.value.code == "model_not_found"
    assert e.value.body["type"] == "invalid_request_error" and e.value.param == "model"

    async def go():
        with pytest.raises(openai.NotFoundError) as e:
            await aio(server).completions.create(model="text-davinci-003", prompt="hi")
        assert e.value.code == "model_not_found"
    asyncio.run(go())


# ------------------------------------------------------------------------------------------------ logprobs
def streamed_chat(chunks):
    """(text, logprob entries, usage) of a streamed chat answer."""
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    return text, entries, next((c.usage for c in chunks if c.usage), None)


def test_greedy_chat_logprobs_are_the_chosen_tokens_streamed_or_not(server):
    whole = chat(server, logprobs=True, top_logprobs=2)
    content, text = whole.choices[0].logprobs.content, whole.choices[0].message.content
    assert len(content) == whole.usage.completion_tokens == 8
    for e in content:   # greedy: the most likely token is the one chosen
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].token == e.token
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob) and e.top_logprobs[1].logprob <= e.logprob <= 0
    assert sum(e.logprob for e in content) <= 0
    assert b"".join(bytes(e.bytes) for e in content).decode() == text
    chunks = list(chat(server, logprobs=True, top_logprobs=2, stream=True, stream_options={"include_usage": True}))
    s_text, s_entries, usage = streamed_chat(chunks)
    assert s_text == text and [e.token for e in s_entries] == [e.token for e in content]
    assert [e.logprob for e in s_entries] == pytest.approx([e.logprob for e in content], abs=1e-4)
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert chat(server).choices[0].logprobs is None   # not asked: null, as OpenAI answers


def test_the_async_client_streams_logprobs_and_sends_requests_at_once(server):
    async def go():
        c = aio(server)
        kw = dict(model=server.model, messages=USER, max_tokens=6, temperature=0, logprobs=True, top_logprobs=1)
        stream = await c.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
        whole, other = await asyncio.gather(c.chat.completions.create(**kw), c.completions.create(
            model=server.model, prompt="One, two, three,", max_tokens=4, temperature=0, logprobs=1))
        return streamed_chat(chunks), whole, other
    (text, entries, usage), whole, other = asyncio.run(go())
    assert text == whole.choices[0].message.content and len(entries) == usage.completion_tokens == 6
    assert [e.token for e in entries] == [e.token for e in whole.choices[0].logprobs.content]
    assert all(e.top_logprobs[0].token == e.token for e in entries)
    assert len(other.choices[0].logprobs.tokens) == other.usage.completion_tokens


def test_completion_logprobs_and_echo_streamed_or_not(server):
    prompt = "One, two, three, four,"
    plain = complete(server, prompt=prompt, logprobs=2)
    lp, text = plain.choices[0].logprobs, plain.choices[0].text
    n = plain.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert max(top, key=top.get) == token and top[token] == pytest.approx(logprob) and logprob <= 0
    assert "".join(lp.tokens) == text and lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(n)]
    echo = complete(server, prompt=prompt, logprobs=2, echo=True)
    e, p = echo.choices[0], echo.usage.prompt_tokens
    assert e.text == prompt + text and echo.usage.completion_tokens == n
    assert len(e.logprobs.tokens) == p + n and "".join(e.logprobs.tokens) == e.text
    assert e.logprobs.token_logprobs[0] is None and e.logprobs.top_logprobs[0] is None
    assert all(x <= 0 for x in e.logprobs.token_logprobs[1:]) and e.logprobs.text_offset[p] == len(prompt)
    assert e.logprobs.token_logprobs[p:] == pytest.approx(lp.token_logprobs, abs=1e-4)
    chunks = list(sync(server).completions.create(model=server.model, prompt=prompt, max_tokens=6, temperature=0,
                                                  logprobs=2, echo=True, stream=True))
    assert chunks[0].choices[0].text == prompt   # the echo comes first, with the prompt's scores
    assert "".join(c.choices[0].text for c in chunks) == e.text
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    offsets = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.text_offset]
    assert tokens == e.logprobs.tokens and offsets == e.logprobs.text_offset
    bare = complete(server, prompt=prompt, echo=True)
    assert bare.choices[0].text == prompt + text and bare.choices[0].logprobs is None


# ------------------------------------------------------------------------------------------------ sampling
REPEAT = "Apple, apple, apple, apple,"   # SmolLM2 goes on: " apple, apple, apple, ..."


def most_repeated(text: str) -> int:
    return max(Counter(text.replace(",", " ").lower().split()).values(), default=0)


def test_penalties_and_logit_bias_change_a_repetitive_answer(server, smollm2):
    _, tok, _ = smollm2
    plain = complete(server, prompt=REPEAT, max_tokens=12).choices[0].text
    assert most_repeated(plain) >= 5   # the model goes on repeating
    for kw in ({"frequency_penalty": 1.5}, {"presence_penalty": 2.0}):
        text = complete(server, prompt=REPEAT, max_tokens=12, **kw).choices[0].text
        assert text != plain and most_repeated(text) < most_repeated(plain), (kw, text)
        streamed = sync(server).completions.create(model=server.model, prompt=REPEAT, max_tokens=12, temperature=0,
                                                   stream=True, **kw)
        assert "".join(c.choices[0].text for c in streamed) == text
    apple = tok.token_to_id("Ġapple")   # " apple"
    banned = complete(server, prompt=REPEAT, max_tokens=12, logprobs=0, logit_bias={str(apple): -100}).choices[0]
    assert banned.text != plain and " apple" not in banned.logprobs.tokens


def test_a_seed_repeats_sampling_and_a_tiny_top_p_is_greedy(server):
    greedy = chat(server).choices[0].message.content
    for seed in (1, 2):
        assert chat(server, temperature=1.5, top_p=1e-6, seed=seed).choices[0].message.content == greedy
    a = chat(server, temperature=1.2, seed=11).choices[0].message.content
    assert chat(server, temperature=1.2, seed=11).choices[0].message.content == a
    streamed = chat(server, temperature=1.2, seed=11, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == a
    assert len({a} | {chat(server, temperature=1.2, seed=s).choices[0].message.content for s in (12, 13, 14)}) > 1


def test_stop_strings_end_the_answer_streamed_or_not(server):
    text = chat(server).choices[0].message.content
    stop = text.strip().split()[1]
    cut = chat(server, stop=[stop, "never seen"])
    assert cut.choices[0].message.content == text[:text.index(stop)] and cut.choices[0].finish_reason == "stop"
    chunks = list(chat(server, stop=stop, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == cut.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_streams_last_chunk_carries_the_logprobs_still_owed(server):
    """The answer stops at its first space: the token holding it adds no text (the stop string cuts it off), so its
    logprob is still owed when the answer ends, and the stream's last chunk carries it; streamed or not, one entry per
    token the usage counts."""
    whole = chat(server, stop=" ", logprobs=True)
    assert whole.usage.completion_tokens >= 2 and " " not in whole.choices[0].message.content
    chunks = list(chat(server, stop=" ", logprobs=True, stream=True, stream_options={"include_usage": True}))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in whole.choices[0].logprobs.content]
    # the second request's prompt comes from the store: its logits agree to float32 rounding, not bit for bit
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in whole.choices[0].logprobs.content],
                                                          abs=1e-3)
    assert len(streamed) == chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


@pytest.mark.parametrize("extra", [{}, {"max_tokens": 8}], ids=["alone", "beside max_tokens"])
def test_max_completion_tokens_bounds_the_answer(server, extra):
    """max_completion_tokens, the field the OpenAI SDK now sends for chat, bounds the answer, and wins over
    max_tokens when both come (as OpenAI reads them)."""
    r = sync(server).chat.completions.create(model=server.model, messages=USER, temperature=0,
                                             max_completion_tokens=3, **extra)
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


def test_logit_bias_takes_every_token_id_of_the_vocabulary_and_no_other(server):
    """The last token id is biased like any other; one past it is refused (400), and the server serves on."""
    with pytest.raises(openai.BadRequestError) as e:
        chat(server, logit_bias={"99999999": 5})
    last = int(e.value.message.split("..")[1].split(")")[0])   # the refusal names the vocabulary: (0..last)
    assert chat(server, logit_bias={str(last): -100}).choices[0].message.content
    with pytest.raises(openai.BadRequestError) as e:
        chat(server, logit_bias={str(last + 1): 5})
    assert e.value.param == "logit_bias"
    assert chat(server).choices[0].message.content


# ------------------------------------------------------------------------------------------------ refused
IMAGE = [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                      {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]
TOOL = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]


@pytest.mark.parametrize("endpoint,kw,field", [
    ("chat", {"response_format": {"type": "json_object"}}, "response_format"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
     "response_format"),
    ("chat", {"tools": TOOL}, "tools"),
    ("chat", {"tool_choice": "auto"}, "tool_choice"),
    ("chat", {"n": 2}, "n"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"reasoning_effort": "low"}, "reasoning_effort"),
    ("chat", {"logit_bias": {"99999999": 5}}, "logit_bias"),
    ("chat", {"messages": IMAGE}, "messages.0.content.1.type"),
    ("chat", {"extra_body": {"top_k": 5}}, "top_k"),
    ("chat", {"stop": [""]}, "stop"),
    ("completions", {"n": 3}, "n"),
    ("completions", {"best_of": 2}, "best_of"),
    ("completions", {"suffix": "the end"}, "suffix"),
    ("completions", {"logprobs": 21}, "logprobs"),
    ("completions", {"extra_body": {"min_p": 0.1}}, "min_p"),
])
def test_a_field_the_engine_cannot_honour_gets_400_naming_it(server, endpoint, kw, field):
    with pytest.raises(openai.BadRequestError) as e:
        chat(server, **kw) if endpoint == "chat" else complete(server, prompt="Hello", **kw)
    assert e.value.status_code == 400 and e.value.param == field and field in e.value.message, e.value.body
    assert "Traceback" not in e.value.message


def test_fields_at_their_plain_values_are_accepted(server):
    plain = chat(server).choices[0].message.content
    same = chat(server, response_format={"type": "text"}, tool_choice="none", n=1, user="u-1", store=False,
                metadata={"team": "l27"}, presence_penalty=0, frequency_penalty=0, top_p=1, seed=None,
                messages=[{"role": "user", "content": [{"type": "text", "text": USER[0]["content"]}], "name": "ann"}])
    assert same.choices[0].message.content == plain
    answered = chat(server).choices[0].message   # sent back as clients do: every field of OpenAI's message, nulls too
    turn = chat(server, messages=[*USER, answered, {**answered.model_dump(), "annotations": []},
                                  {"role": "user", "content": "One more?"}])
    assert turn.choices[0].message.content


# ------------------------------------------------------------------------------------------------ usage
@pytest.mark.parametrize("endpoint,kw", [
    ("chat", {}), ("chat", {"logprobs": True, "top_logprobs": 3}), ("chat", {"extra_body": {"kv_check": True}}),
    ("chat", {"messages": [{"role": "user", "content": "Smileys: 😀 😃 😄 😁 (reply in smileys)"}], "logprobs": True}),
    ("completions", {"prompt": "The days of the week are"}),
    ("completions", {"prompt": "Smileys: 😀 😃 😄 😁", "logprobs": 1}),   # tokens holding parts of a character
    ("completions", {"prompt": "The days of the week are", "echo": True, "logprobs": 1}),
])
def test_usage_is_counted_alike_on_every_path(server, endpoint, kw):
    create = sync(server).chat.completions.with_raw_response.create if endpoint == "chat" else \
        sync(server).completions.with_raw_response.create
    base = {"model": server.model, "max_tokens": 5, "temperature": 0, **({"messages": USER} if endpoint == "chat"
                                                                         else {}), **kw}
    raw = create(**base)
    whole = raw.parse()
    raw_s = create(**base, stream=True, stream_options={"include_usage": True})
    chunks = list(raw_s.parse())
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage is not None
    for u, r in ((whole.usage, raw), (usage, raw_s)):
        kv = parse_kv(r.headers["x-kv-cache"])
        assert u.prompt_tokens_details.cached_tokens == kv["prefix"] + kv["blended"]
        assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert (usage.prompt_tokens, usage.completion_tokens) == (whole.usage.prompt_tokens, whole.usage.completion_tokens)
    lp = whole.choices[0].logprobs
    if lp is not None:
        n = len(lp.content) if endpoint == "chat" else len(lp.tokens) - whole.usage.prompt_tokens * bool(kw.get("echo"))
        assert n == whole.usage.completion_tokens
    if endpoint == "chat" and lp is not None and "\ufffd" not in whole.choices[0].message.content:
        assert b"".join(bytes(e.bytes) for e in lp.content).decode() == whole.choices[0].message.content


# ------------------------------------------------------------------------------------------------ separator
def rag_message(order) -> list:
    return [{"role": "system", "content": "Answer from the documents."},
            {"role": "user", "content": SEPARATOR.join([DOCS[i] for i in order] + [QUESTION])}]


def test_documents_in_one_message_cut_by_the_separator_come_back_in_another_order(server, smollm2):
    """RAG as RAG code sends it: six documents in one user message, the separator between them. Sent again in another
    order the moment the first answer ends: at least 85% of the documents' tokens come from the store, blended, and
    the first answer token's KL to a full prefill (kv_check) is small."""
    _, tok, _ = smollm2
    doc_tokens = sum(len(tok.encode(d).ids) + len(tok.encode(SEPARATOR).ids) for d in DOCS)
    c = sync(server)
    first = c.chat.completions.create(model=server.model, messages=rag_message(range(6)), max_tokens=8, temperature=0)
    raw = c.chat.completions.with_raw_response.create(model=server.model, messages=rag_message((3, 5, 1, 0, 4, 2)),
                                                      max_tokens=8, temperature=0, extra_body={"kv_check": True})
    again, kv = raw.parse(), parse_kv(raw.headers["x-kv-cache"])
    cached = again.usage.prompt_tokens_details.cached_tokens
    kl = again.model_extra["kv_cache"]["first_token_kl"]
    print(f"\nseparator: {cached} of {again.usage.prompt_tokens} prompt tokens cached, {cached / doc_tokens:.0%} of "
          f"the documents' {doc_tokens}; first-token KL {kl:.4f} nats; {raw.headers['x-kv-cache']}")
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert kv["path"] == "blend" and cached >= 0.85 * doc_tokens and cached == kv["prefix"] + kv["blended"]
    assert -1e-5 <= kl < 0.5
    assert again.choices[0].message.content


def test_a_completion_cut_by_the_separator_reuses_its_pieces(server, smollm2):
    """LMCache's own convention, a completion's text: the system prompt, the separator, each document and the
    separator, the question. Sent again in another order once the first is stored, the documents come from the
    store, blended."""
    _, tok, _ = smollm2
    doc_tokens = sum(len(tok.encode(d).ids) + len(tok.encode(SEPARATOR).ids) for d in DOCS)

    def prompt(order):
        return SEPARATOR.join(["Read the documents, then answer."] + [DOCS[i] for i in order] +
                              [f"Question: {QUESTION}\nAnswer: the deeper lake is"])
    complete(server, prompt=prompt(range(6)), max_tokens=6)
    assert bench.wait_idle(server.url)   # its pieces stored (prefilled alone behind the first piece)
    raw = sync(server).completions.with_raw_response.create(model=server.model, prompt=prompt((5, 4, 3, 2, 1, 0)),
                                                            max_tokens=6, temperature=0, extra_body={"kv_check": True})
    again, kv = raw.parse(), parse_kv(raw.headers["x-kv-cache"])
    assert kv["path"] == "blend" and again.usage.prompt_tokens_details.cached_tokens >= 0.85 * doc_tokens
    assert again.model_extra["kv_cache"]["first_token_kl"] < 0.5 and again.choices[0].text


def test_bad_chunks_get_an_answer_or_a_clean_400_and_others_are_served(server):
    """A separator inside a word, two separators in a row, 150 chunks in one message (sent twice, in two orders), a
    chunk longer than the context: each a 200 with an answer or one clean 400, while a plain request sent beside them
    is answered; no request fails inside the engine."""
    errors = metric(server, 'l27_request_errors_total{status="500"}')
    facts = [f"{i}." for i in range(150)]   # about 6 tokens a chunk with the separator
    ok = {
        "a word cut": "Lake Va" + SEPARATOR + "rna is deep" + SEPARATOR + "Is Lake Varna deep?",
        "two in a row": DOCS[0] + SEPARATOR + SEPARATOR + QUESTION,
        "starts and ends with one": SEPARATOR + DOCS[1] + SEPARATOR,
        "150 chunks": SEPARATOR.join(facts + ["Which number comes after 3?"]),
        "150 chunks again": SEPARATOR.join(facts[::-1] + ["Which number comes after 3?"]),
    }
    too_long = SEPARATOR.join([DOCS[0], "word " * 9000, QUESTION])

    def ask(content):
        return chat(server, messages=[{"role": "user", "content": content}], max_tokens=3)
    with ThreadPoolExecutor(3) as pool:
        beside = pool.submit(chat, server, max_tokens=4)
        for name, content in ok.items():
            r = ask(content)
            assert r.choices[0].message.content and r.usage.completion_tokens >= 1, name
        with pytest.raises(openai.BadRequestError) as e:
            ask(too_long)
        assert e.value.code == "context_length_exceeded"
        assert beside.result(300).choices[0].message.content
    assert chat(server, max_tokens=4).choices[0].message.content
    assert metric(server, 'l27_request_errors_total{status="500"}') == errors == 0
