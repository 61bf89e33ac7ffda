"""A server bench_serve.py runs, as one object built from its command line: what the tables and --json call it,
where it listens, how it came to run (started here with its flags, or given by --url), the CacheBlend ratio ours
runs at, whether it is a peer, and from those what it reuses and how a peer's full prefill of a request is asked."""
from __future__ import annotations

import secrets
from dataclasses import dataclass

from lecture27.serving import launch

REUSES = {"store": "prefixes exactly; messages in any order, blended",
          "no_store": "nothing (every prompt prefilled)",
          "serial": "what store reuses, running one request at a time (--max-running 1)",
          "vllm": "exact prefixes (its prefix cache: 16-token blocks keyed by every token before them)",
          "llama.cpp": "the common prefix of a slot's last prompt, then runs of 256 or more of its tokens that come "
                       "back later in the new prompt, in their order, shifted there by RoPE (--cache-reuse 256); "
                       "nothing recomputed"}
REUSE_SHORT = {"store": "exact prefix; chunks blended, 15% recomputed", "no_store": "nothing",
               "serial": "as store", "vllm": "exact prefix", "llama.cpp": "shifted chunks, no recompute"}
# A peer's full prefill of a RAG request, on the same server: (what the request says, its extra body).
REFERENCE = {"vllm": ("the same request with a cache_salt of its own (no block of the prefix cache matches it)",
                      lambda: {"cache_salt": secrets.token_hex(8)}),
             "llama.cpp": ("the same request with cache_prompt false (no cached token used)",
                           lambda: {"cache_prompt": False})}


@dataclass(frozen=True)
class BenchServer:
    """One server of a benchmark run and the workloads it runs."""
    role: str                            # store, no_store, serial (ours with the store, without it, one request at
                                         # a time), vllm, llama.cpp (the peers), or a --url's NAME (server1, ...)
    workloads: tuple = ()
    process: launch.Server | None = None   # started here with its flags (process.argv); None: given by --url
    given_url: str | None = None         # --url's /v1 URL
    ratio: float | None = None           # ours started with the store at this CacheBlend recompute ratio
                                         # (serve.py --ratio R); None: serve.py's own, or not ours
    peer: bool = False                   # vLLM's or llama.cpp's server: its full prefill is REFERENCE's request
    only_ours: bool = False              # started for our client's comparisons alone: vLLM's client skips it

    @property
    def name(self) -> str:
        """What the tables and --json call it: its role, ours at another ratio store@R (store@0.6)."""
        return self.role if self.ratio is None else f"{self.role}@{self.ratio:g}"

    @property
    def url(self) -> str | None:
        """Its /v1 URL: --url's, or the process's once it listens."""
        return self.given_url if self.process is None else self.process.url

    def start(self) -> str:
        """Start the process of a server started here (launch.Server.start: a RuntimeError if it does not serve);
        its /v1 URL."""
        if self.process is not None:
            self.process.start()
        return self.url

    def __enter__(self) -> "BenchServer":
        return self

    def __exit__(self, *exc) -> None:
        """Stop the process started here, if it runs (launch.Server.stop)."""
        if self.process is not None:
            self.process.stop()

    def reuses(self, short: bool = False) -> str:
        """What it reuses (REUSES; short: REUSE_SHORT, the quality table's words); at a ratio of its own, store's
        at that ratio."""
        if self.ratio is not None:
            return f"exact prefix; chunks blended, {self.ratio:.0%} recomputed" if short else \
                f"what store reuses, {self.ratio:.0%} recomputed (serve.py --ratio {self.ratio:g})"
        return REUSE_SHORT.get(self.role, "?") if short else REUSES.get(self.role, "whatever it reuses")

    @property
    def full_prefill(self) -> tuple | None:
        """A peer's full prefill of a RAG request (REFERENCE: what it says, its extra body); None: not a peer."""
        return REFERENCE.get(self.role) if self.peer else None


def named(servers: list, name: str) -> BenchServer:
    """The server of `servers` a run names (bench.Run.server); a name none has, a server of that role given by
    --url."""
    return next((s for s in servers if s.name == name), None) or BenchServer(name)
