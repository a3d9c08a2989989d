"""A KV store on a Redis or Valkey server, shared by every engine that reaches it (redis-py; `pip install 'deepinfer[redis]'`).

URLs: `redis://[user:password@]host[:port][/db]`, `rediss://...` (TLS), `valkey://...` and `valkeys://...` (the
same protocol: read as redis:// and rediss://), `unix:///path/to/redis.sock?db=0` (a local socket: RedisStore and
open_url read it, but no entry point claims the generic unix:// scheme). The query may carry this store's options
(`ttl_s`, `prefix`, `timeout_s`, `backoff_s`, `max_backoff_s`, `max_value_bytes`) and a few of redis-py's own
(`db`, `username`, `password`, `client_name`, `max_connections`, the `ssl_*` file and check options).

- **One Redis string per entry**, named `prefix + key`, holding the bytes given (`block_codec.encode`'s output).
  What a `get` reads is checked with `block_codec.verify`; a damaged entry is deleted and counted `corrupt`.
- **TTL per entry.** With `ttl_s`, a put is SET ... PX (milliseconds, so a fractional ttl_s holds) and a get is
  GETEX ... PX: an entry in use lives on, one unused for `ttl_s` expires (the disk store's LRU within its TTL,
  done by the server). `contains` is EXISTS, which neither refreshes the TTL nor counts as a use for the
  server's LRU. GETEX needs Redis >= 6.2 (any Valkey).
- **The server bounds itself**: configure `maxmemory` and an LRU policy (`maxmemory-policy allkeys-lru`, or
  `volatile-lru` when every entry has a TTL). The client enforces no byte capacity; it refuses (`rejected`)
  only a value over `max_value_bytes` (Redis's default `proto-max-bulk-len`, 512 MiB), which the server
  would answer by dropping the connection. The server evicts and expires entries unseen: this store's
  `evictions` and `expired` stay 0, and so do `entries` / `bytes_held` (the server holds every client's
  entries; counting them would take a SCAN of the whole key space, and the count would drift as the
  server expires and evicts).
- **Faults degrade, quietly.** A server that is unreachable, times out or refuses the login turns every call
  into a miss / False counted in `errors`, with one warning line when it goes down (the URL without its
  password, and the error) and one info line when it works again. While it is down the store backs off:
  calls are skipped (a miss / False, counted in `errors`, no network) until `backoff_s` has passed, then one
  call tries; each failed try doubles the wait, up to `max_backoff_s`. The clock is injectable (`clock`), so
  tests never sleep. A server that answers but refuses a command (out of memory under `noeviction`, a
  read-only replica, a key of another type) is not down: that call fails, counted, logged once per kind.
  Sockets time out after `timeout_s` (connect and each reply), and redis-py's own retries are off, so an
  engine loop waits at most about that long on a dead server, and only once per backoff interval.
- **Opening never connects**: a store opened while the server is down starts working when it comes up.

Passwords (in the URL's user info or its `password=` query) appear in no log line, error or repr.
"""

from __future__ import annotations

import inspect
import logging
import math
import re
import threading
import time
from dataclasses import replace
from typing import Callable
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

from deepinfer.kv_tiers.block_codec import CorruptBlock
from deepinfer.kv_tiers.block_codec import verify as verify_block
from deepinfer.kv_tiers.open_store import parse_size, url_options
from deepinfer.kv_tiers.store import FirstOfKind, StoreStats, check_key

logger = logging.getLogger(__name__)

DEFAULT_PREFIX = "deepinfer:kv:"
MAX_VALUE_BYTES = 512 << 20  # Redis's default proto-max-bulk-len
# valkey:// speaks the Redis protocol; redis-py knows only the redis names.
SCHEMES = {"redis": "redis", "rediss": "rediss", "valkey": "redis", "valkeys": "rediss", "unix": "unix"}
STORE_OPTIONS = ("ttl_s", "prefix", "timeout_s", "backoff_s", "max_backoff_s", "max_value_bytes")
# redis-py's query options passed through; its socket timeouts and retries are this store's to set.
SSL_OPTIONS = ("ssl_cert_reqs", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_check_hostname")
CLIENT_OPTIONS = ("db", "username", "password", "client_name", "max_connections", *SSL_OPTIONS)
_FAILED = object()  # a call that the server did not answer (skipped, unreachable or refused)


def redact(url: str) -> str:
    """`url` with its password (user info or `password=` query) replaced by ***: for logs, errors and repr."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, hostport = netloc.rpartition("@")
        user, colon, _ = userinfo.partition(":")
        netloc = f"{user}:***@{hostport}" if colon else netloc
    query = re.sub(r"(^|&)password=[^&]*", r"\1password=***", parts.query)
    return _join(parts.scheme, netloc, parts.path, query)


def _join(scheme: str, netloc: str, path: str, query: str) -> str:
    """A URL from its parts; by hand, since urlunsplit turns unix:///path (no host) into unix:/path."""
    return f"{scheme}://{netloc}{path}" + (f"?{query}" if query else "")


def _import_redis():
    try:
        import redis
        import redis.backoff
        import redis.retry
    except ImportError:
        raise ImportError("the redis KV store needs redis-py, which is not installed: pip install 'deepinfer[redis]'") from None
    return redis


def _seconds(url: str, name: str, value, *, none_ok: bool = False) -> float | None:
    if value is None and none_ok:
        return None
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        also = " (or leave it out: no expiry)" if none_ok else ""
        raise ValueError(f"{url!r}: a redis KV store's {name} is a positive number of seconds{also}, got {value!r}")
    return seconds


class RedisStore:
    """`url`: the server (see the module docstring); its query may set the options below that are left at
    their defaults here (a keyword argument other than the default wins over the query).
    `ttl_s`: an entry's lifetime since its last put or get (None: no expiry). `prefix`: put before every
    key (stores with different prefixes on one server do not see each other's entries). `timeout_s`:
    the socket's connect and reply timeout. `backoff_s` / `max_backoff_s`: the first and the longest wait
    before trying a server that went down again. `max_value_bytes`: a larger value is refused. `verify`:
    checks the bytes read (raises CorruptBlock; None: no check). `clock`: seconds, for the backoff
    (time.monotonic)."""

    def __init__(
        self,
        url: str,
        *,
        ttl_s: float | None = None,
        prefix: str = DEFAULT_PREFIX,
        timeout_s: float = 1.0,
        backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        max_value_bytes: int = MAX_VALUE_BYTES,
        verify: Callable[[bytes], None] | None = verify_block,
        clock: Callable[[], float] = time.monotonic,
    ):
        if not isinstance(url, str):
            raise ValueError(f"a redis KV store's url is a string such as redis://host:6379/0, got {type(url).__name__}")
        self.url = redact(url)
        client_url, query = self._client_url(url)
        given = dict(ttl_s=ttl_s, prefix=prefix, timeout_s=timeout_s, backoff_s=backoff_s, max_backoff_s=max_backoff_s, max_value_bytes=max_value_bytes)
        query_options = url_options(self.url, {}, STORE_OPTIONS + CLIENT_OPTIONS)
        options = {name: query_options[name] if value == _DEFAULTS[name] and name in query_options else value for name, value in given.items()}

        self.ttl_s = _seconds(self.url, "ttl_s", options["ttl_s"], none_ok=True)
        self.timeout_s = _seconds(self.url, "timeout_s", options["timeout_s"])
        self.backoff_s = _seconds(self.url, "backoff_s", options["backoff_s"])
        self.max_backoff_s = max(self.backoff_s, _seconds(self.url, "max_backoff_s", options["max_backoff_s"]))
        self.prefix = options["prefix"]
        if not isinstance(self.prefix, str):
            raise ValueError(f"{self.url!r}: a redis KV store's prefix is a string (such as {DEFAULT_PREFIX!r}), got {type(self.prefix).__name__}")
        try:
            self.max_value_bytes = parse_size(options["max_value_bytes"])
        except ValueError as e:
            raise ValueError(f"{self.url!r}: max_value_bytes: {e}") from None
        if self.max_value_bytes < 1:
            raise ValueError(f"{self.url!r}: a redis KV store's max_value_bytes must be >= 1, got {self.max_value_bytes}")
        self._ttl_ms = None if self.ttl_s is None else max(1, round(self.ttl_s * 1000))
        self._verify = verify
        self._clock = clock
        self._lock = threading.Lock()
        self._logged = FirstOfKind()  # what was logged once
        self._stats = StoreStats()
        self._down = False  # since the last failed call, until one succeeds
        self._backoff = self.backoff_s
        self._retry_at = 0.0
        self._missed = 0  # calls failed or skipped while down
        self._secrets = self._passwords(url, query)

        redis = _import_redis()
        self._down_errors = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)
        self._redis_error = redis.exceptions.RedisError
        try:
            self._client = redis.Redis.from_url(
                client_url,
                socket_connect_timeout=self.timeout_s,
                socket_timeout=self.timeout_s,
                retry=redis.retry.Retry(redis.backoff.NoBackoff(), 0),  # this store backs off itself, without blocking a caller
            )
        except ValueError as e:  # a query value redis-py cannot read
            raise ValueError(f"{self.url!r}: {self._hide(str(e))}") from None

    def _client_url(self, url: str) -> tuple[str, list[tuple[str, str]]]:
        """The URL redis-py reads (redis:// for valkey://, without this store's options) and its query; ValueError naming a bad part."""
        parts = urlsplit(url)
        scheme = SCHEMES.get(parts.scheme.lower())
        if scheme is None:
            raise ValueError(f"{self.url!r}: a redis KV store's URL is redis://host:6379/0, rediss:// (TLS), valkey://, valkeys:// or unix:///path.sock")
        if scheme == "unix":
            if not parts.path:
                raise ValueError(f"{self.url!r}: a redis KV store on a local socket is unix:///path/to/redis.sock (the socket's path; ?db=N for a database)")
        else:
            try:
                parts.port
            except ValueError:
                raise ValueError(f"{self.url!r}: the port is not a number from 0 to 65535: redis://host:6379/0") from None
            if not re.fullmatch(r"/?(\d+)?", unquote(parts.path)):
                raise ValueError(f"{self.url!r}: the path is the database number (redis://host:6379/0), got {parts.path!r}")
        query = parse_qsl(parts.query, keep_blank_values=True)
        kept = [(name, value) for name, value in query if name not in STORE_OPTIONS]
        return _join(scheme, parts.netloc, parts.path, urlencode(kept)), query

    @staticmethod
    def _passwords(url: str, query: list[tuple[str, str]]) -> list[str]:
        """Every spelling of the URL's passwords, to scrub from error texts that might echo them."""
        found = [value for name, value in query if name == "password" and value]
        password = urlsplit(url).password
        if password:
            found += [password, unquote(password)]
        return sorted(set(found), key=len, reverse=True)

    def _hide(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return " ".join(text.split())  # one line

    def __repr__(self) -> str:
        return f"RedisStore({self.url!r}, ttl_s={self.ttl_s}, prefix={self.prefix!r})"

    def close(self) -> None:
        """Close the client's connections (a later call opens new ones)."""
        self._client.close()

    # --- the protocol ---

    def get(self, key: str) -> bytes | None:
        name = self.prefix + check_key(key)
        data = self._run("getex", name, px=self._ttl_ms) if self._ttl_ms else self._run("get", name)
        if data is _FAILED or data is None:
            return self._miss()
        if self._verify is not None:
            try:
                self._verify(data)
            except CorruptBlock as e:
                if self._logged.first(("corrupt", e.reason)):
                    logger.warning("redis KV store %s: deleted a damaged entry %s (%s; logged once per kind, the rest counted as corrupt)", self.url, name, e)
                self._run("delete", name)  # a writer of the same key meanwhile wrote the same bytes: a lost entry at worst
                with self._lock:
                    self._stats.corrupt += 1
                return self._miss()
        with self._lock:
            self._stats.hits += 1
        return data

    def put(self, key: str, value: bytes) -> bool:
        name = self.prefix + check_key(key)
        value = bytes(value)
        if len(value) > self.max_value_bytes:
            with self._lock:
                self._stats.rejected += 1
            return False
        if self._run("set", name, value, px=self._ttl_ms) is _FAILED:
            return False
        with self._lock:
            self._stats.stores += 1
            self._stats.bytes_stored += len(value)
        return True

    def contains(self, key: str) -> bool:
        found = self._run("exists", self.prefix + check_key(key))
        return found is not _FAILED and found > 0

    def delete(self, key: str) -> bool:
        removed = self._run("delete", self.prefix + check_key(key))
        return removed is not _FAILED and removed > 0

    def stats(self) -> StoreStats:
        """This client's counters; `evictions`, `expired`, `entries` and `bytes_held` stay 0 (the server's to know: see the module docstring)."""
        with self._lock:
            return replace(self._stats)

    # --- talking to the server ---

    def _run(self, command: str, *args, **kwargs):
        """The server's answer to the client's `command`, or _FAILED if the store is backing off or the server failed (counted, logged)."""
        if not self._admit():
            return _FAILED
        try:
            answer = getattr(self._client, command)(*args, **kwargs)
        except self._down_errors as e:
            self._went_down(e)
            return _FAILED
        except self._redis_error as e:  # the server answered, with an error
            self._works()
            self._refused(command, e)
            return _FAILED
        self._works()
        return answer

    def _admit(self) -> bool:
        """Whether a call may go to the server now: always while it works; while it is down, one call once the backoff has passed."""
        if not self._down:
            return True
        with self._lock:
            if not self._down:
                return True
            now = self._clock()
            if now < self._retry_at:
                self._stats.errors += 1
                self._missed += 1
                return False
            self._retry_at = now + self._backoff  # this call tries; the others keep skipping meanwhile
            return True

    def _went_down(self, e: Exception) -> None:
        with self._lock:
            self._stats.errors += 1
            first = not self._down
            if first:
                self._down, self._backoff, self._missed = True, self.backoff_s, 1
            else:
                self._backoff, self._missed = min(2 * self._backoff, self.max_backoff_s), self._missed + 1
            self._retry_at = self._clock() + self._backoff
        if first:
            logger.warning(
                "redis KV store %s is down: %s: %s (gets miss and puts fail, counted in errors; tried again after %g s, then at doubling intervals up to %g s; "
                "logged once until it works again)",
                self.url,
                type(e).__name__,
                self._hide(str(e)),
                self.backoff_s,
                self.max_backoff_s,
            )

    def _works(self) -> None:
        if not self._down:
            return
        with self._lock:
            if not self._down:
                return
            self._down, self._backoff, missed = False, self.backoff_s, self._missed
        logger.info("redis KV store %s works again (%d calls failed or were skipped while it was down)", self.url, missed)

    def _refused(self, command: str, e: Exception) -> None:
        text = self._hide(str(e))
        kind = f"{type(e).__name__} {text.split(' ', 1)[0]}"  # a plain ResponseError's kind is its first word: "ResponseError WRONGTYPE"
        with self._lock:
            self._stats.errors += 1
        if self._logged.first(("refused", kind)):
            logger.warning("redis KV store %s refused %s: %s: %s (counted in errors; logged once per kind)", self.url, command.upper(), type(e).__name__, text)

    def _miss(self) -> None:
        with self._lock:
            self._stats.misses += 1
        return None


_DEFAULTS = {name: p.default for name, p in inspect.signature(RedisStore).parameters.items() if name in STORE_OPTIONS}


def open_url(url: str, **options) -> RedisStore:
    """The "redis", "rediss", "valkey" and "valkeys" entry points of "deepinfer.kv_stores":
    `redis://host:6379/0?ttl_s=3600&prefix=deepinfer:kv:` (the options also as keyword arguments: one other than its default wins)."""
    return RedisStore(url, **options)
