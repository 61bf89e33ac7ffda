"""The chunk store's remote tier (kvstore.py): a real Redis server, the store that engines on other processes
(or machines) share, as LMCache's `remote_url: "redis://host:port"` backend is. The server is one this process
runs (common.redis_server.RedisServer, on a unix socket) or one a URL names.

`RedisTier(url, budget)` holds records under one namespace with a byte budget and LRU eviction kept in the
server itself (a sorted set of last uses, a hash of sizes), each put and its evictions one Lua script, so every
process that shares the server sees one LRU order and one budget. Without the redis client, or with no server
answering at `url`, common.redis_server.RedisUnavailable says so in one line; RAM and disk need neither.
"""
from __future__ import annotations

from typing import NamedTuple

from common.redis_server import connect


class NamespaceKeys(NamedTuple):
    """The Redis keys of one namespace, in the order the Lua scripts read them (KEYS[1] .. KEYS[6])."""
    lru: str          # sorted set: record name -> its last use on the namespace's clock
    size: str         # hash: record name -> its bytes
    used: str         # the bytes of every record held
    clock: str        # a counter, one tick per put or touch
    record: str       # the prefix of a record's own key: <record><name> holds its bytes
    evictions: str    # records evicted so far


# Lua, run atomically by the server. KEYS: a NamespaceKeys (the LRU set, size hash, byte count, clock, record
# prefix, eviction count).
_PUT = """
local name, blob, budget = ARGV[1], ARGV[2], tonumber(ARGV[3])
local t = redis.call('INCR', KEYS[4])
if redis.call('HEXISTS', KEYS[2], name) == 1 then redis.call('ZADD', KEYS[1], t, name) return 1 end
local n = string.len(blob)
if n > budget then return 0 end
local used = tonumber(redis.call('GET', KEYS[3]) or '0')
local evicted = 0
while used + n > budget do
  local victim = redis.call('ZRANGE', KEYS[1], 0, 0)[1]
  used = used - tonumber(redis.call('HGET', KEYS[2], victim))
  redis.call('DEL', KEYS[5] .. victim)
  redis.call('ZREM', KEYS[1], victim)
  redis.call('HDEL', KEYS[2], victim)
  evicted = evicted + 1
end
redis.call('SET', KEYS[5] .. name, blob)
redis.call('ZADD', KEYS[1], t, name)
redis.call('HSET', KEYS[2], name, n)
redis.call('SET', KEYS[3], used + n)
redis.call('INCRBY', KEYS[6], evicted)
return 1
"""
_TOUCH = """
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 0 then return 0 end
redis.call('ZADD', KEYS[1], redis.call('INCR', KEYS[4]), ARGV[1])
return 1
"""
_DISCARD = """
local n = redis.call('HGET', KEYS[2], ARGV[1])
if not n then return 0 end
redis.call('DEL', KEYS[5] .. ARGV[1])
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('DECRBY', KEYS[3], n)
return 1
"""
_EVICT_OLDEST = """
local victim = redis.call('ZRANGE', KEYS[1], 0, 0)[1]
if not victim then return 0 end
local n = tonumber(redis.call('HGET', KEYS[2], victim))
redis.call('DEL', KEYS[5] .. victim)
redis.call('ZREM', KEYS[1], victim)
redis.call('HDEL', KEYS[2], victim)
redis.call('DECRBY', KEYS[3], n)
return n
"""


class RedisTier:
    """Records in a Redis server under `namespace`, LRU within a byte budget kept by the server."""
    name = "redis"

    def __init__(self, url: str, budget: int, namespace: str = "l27kv"):
        self.url, self.budget, self.namespace = url, budget, namespace
        self.client = connect(url)
        ns = "{" + namespace + "}"   # one hash slot for all of the namespace's keys
        self.keys = NamespaceKeys(lru=f"{ns}:lru", size=f"{ns}:size", used=f"{ns}:used", clock=f"{ns}:clock",
                                  record=f"{ns}:rec:", evictions=f"{ns}:evictions")
        self._put, self._touch, self._discard, self._evict = (self.client.register_script(s)
                                                              for s in (_PUT, _TOUCH, _DISCARD, _EVICT_OLDEST))

    @property
    def used(self) -> int:
        return int(self.client.get(self.keys.used) or 0)

    @property
    def evictions(self) -> int:
        return int(self.client.get(self.keys.evictions) or 0)

    def names(self) -> list:
        return [n.decode() for n in self.client.zrange(self.keys.lru, 0, -1)]

    def has(self, name: str) -> bool:
        return bool(self.client.hexists(self.keys.size, name))

    def touch(self, name: str) -> bool:
        return bool(self._touch(keys=self.keys, args=[name]))

    def put(self, name: str, blob: bytes) -> bool:
        return bool(self._put(keys=self.keys, args=[name, bytes(blob), self.budget]))

    def get(self, name: str):
        pipe = self.client.pipeline(transaction=False)
        pipe.get(self.keys.record + name)
        self._touch(keys=self.keys, args=[name], client=pipe)
        blob, _ = pipe.execute()
        return blob

    def discard(self, name: str) -> None:
        self._discard(keys=self.keys, args=[name])

    def evict_oldest(self) -> int:
        """Remove the least recently used record (as a put that needs room does, inside its script); its bytes."""
        return int(self._evict(keys=self.keys))

    def drop_cache(self, name: str) -> None:
        """Nothing to drop: the server keeps records in its memory."""

    def clear(self) -> None:
        """Delete every key of the namespace."""
        keys = list(self.client.scan_iter(match="{" + self.namespace + "}:*", count=1000))
        if keys:
            self.client.delete(*keys)

    def close(self) -> None:
        self.client.close()
