"""RedisStore against a real redis-server that these tests start on loopback: round trips of encoded blocks,
TTL set on put and refreshed on get (read back with the server's PTTL), damaged entries deleted, a killed
server degrading to misses with one warning and an injected-clock backoff, then used again once restarted;
stores and processes sharing entries; open_store's redis:// and valkey:// URLs; bad URLs; passwords kept
out of repr, errors and logs.

Without redis-server on PATH (apt-get install redis-server) or redis-py (pip install 'deepinfer[redis]') the
tests that need them skip, unless DEEPINFER_REQUIRE_REDIS=1 (CI sets it, .ci/run installs redis-server):
then they fail."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from deepinfer.distributed.environment import free_port
from deepinfer.kv_tiers import redis_store
from deepinfer.kv_tiers.block_codec import decode, encode
from deepinfer.kv_tiers.keys import KVNamespace
from deepinfer.kv_tiers.open_store import open_store, store_factories
from deepinfer.kv_tiers.redis_store import DEFAULT_PREFIX, RedisStore, redact
from deepinfer.kv_tiers.store import KVStore

from waits import HANG_S, wait_until

NS = KVNamespace(model="tiny-v3", config_hash="c0ffee", dtype="bfloat16", kv_cache_dtype="bfloat16", kv_layout_version=1, block_size=16)
KEYS = [NS.key(bytes([i]) * 16) for i in range(8)]
PASSWORD = "hunter2-not-for-logs"
LOGGER = "deepinfer.kv_tiers.redis_store"


def block(i: int) -> bytes:
    return encode({"kv": torch.full((2, 16, 8), float(i), dtype=torch.bfloat16), "scales": torch.arange(16, dtype=torch.float32) + i}, NS)


SIZE = len(block(0))


class Clock:
    def __init__(self, now: float = 1_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def need(redis_server: bool = True) -> None:
    """Skip (or, with DEEPINFER_REQUIRE_REDIS=1, fail) when what the test needs is not installed."""
    missing = []
    if redis_server and shutil.which("redis-server") is None:
        missing.append("redis-server is not on PATH (apt-get install redis-server)")
    try:
        import redis  # noqa: F401
    except ImportError:
        missing.append("redis-py is not installed (pip install 'deepinfer[redis]')")
    if missing:
        reason = "; ".join(missing)
        if os.environ.get("DEEPINFER_REQUIRE_REDIS") == "1":
            pytest.fail(f"{reason}, and DEEPINFER_REQUIRE_REDIS=1 requires the redis KV store's tests to run", pytrace=False)
        pytest.skip(f"{reason}; DEEPINFER_REQUIRE_REDIS=1 makes this a failure")


class RedisServer:
    """A redis-server on a free loopback port and a unix socket in `folder`, no persistence; ready once it answers PING."""

    def __init__(self, folder: Path, *flags: str):
        self.folder = folder
        self.flags = flags
        self.port = free_port()  # redis-server has no --port 0: a port free a moment ago
        self.socket = folder / "redis.sock"
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.start()

    def start(self) -> None:
        argv = [shutil.which("redis-server"), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        argv += ["--dir", str(self.folder), "--logfile", str(self.folder / "redis.log"), "--unixsocket", str(self.socket), "--unixsocketperm", "700"]
        self.proc = subprocess.Popen([*argv, *self.flags], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            wait_until(self.answers, f"redis-server on port {self.port} answering PING (its log: {self.folder / 'redis.log'})", self.proc)
        except BaseException:
            self.kill()
            raise

    def answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=HANG_S) as s:
                s.sendall(b"PING\r\n")
                return s.recv(64).startswith((b"+PONG", b"-NOAUTH"))  # -NOAUTH: it answers, and wants the password
        except OSError:  # not listening yet
            return False

    def client(self, password: str | None = None):
        import redis

        return redis.Redis(port=self.port, password=password, socket_timeout=HANG_S)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=HANG_S)
        self.proc.stderr.close()


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory):
    need()
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server
    server.kill()


@pytest.fixture
def server(shared_server):
    """The module's server, emptied."""
    shared_server.client().flushall()
    return shared_server


@pytest.fixture
def own_server(tmp_path):
    """A server of this test alone (it may be killed and restarted)."""
    need()
    server = RedisServer(tmp_path)
    yield server
    server.kill()


def test_the_entry_points_open_the_redis_store():
    found = store_factories()
    for scheme in ("redis", "rediss", "valkey", "valkeys"):
        assert found[scheme].load() is redis_store.open_url, scheme


def test_round_trip_of_an_encoded_block(server):
    store = RedisStore(server.url)
    assert isinstance(store, KVStore)
    assert store.put(KEYS[0], block(0))
    data = store.get(KEYS[0])
    assert data == block(0)
    assert torch.equal(decode(data, NS)["kv"], torch.zeros(2, 16, 8, dtype=torch.bfloat16))
    assert server.client().get(DEFAULT_PREFIX + KEYS[0]) == block(0)  # the bytes given, under prefix + key
    assert store.get(KEYS[1]) is None
    stats = store.stats()
    assert (stats.hits, stats.misses, stats.stores, stats.bytes_stored, stats.errors, stats.corrupt) == (1, 1, 1, SIZE, 0, 0)
    assert (stats.entries, stats.bytes_held, stats.evictions, stats.expired) == (0, 0, 0, 0)  # the server's to know


def test_contains_and_delete(server):
    store = RedisStore(server.url)
    assert not store.contains(KEYS[0]) and not store.delete(KEYS[0])
    store.put(KEYS[0], block(0))
    assert store.contains(KEYS[0])
    assert store.delete(KEYS[0])
    assert not store.contains(KEYS[0]) and store.get(KEYS[0]) is None and not store.delete(KEYS[0])
    with pytest.raises(ValueError, match="key"):
        store.put("../x", b"x")


def test_ttl_is_set_on_put_and_refreshed_by_get_not_by_contains(server):
    client = server.client()
    name = DEFAULT_PREFIX + KEYS[0]
    store = RedisStore(server.url, ttl_s=100)
    store.put(KEYS[0], block(0))
    assert 90_000 < client.pttl(name) <= 100_000
    client.pexpire(name, 5_000)  # as if 95 s had passed
    assert store.contains(KEYS[0]) and client.pttl(name) <= 5_000  # not a use
    assert store.get(KEYS[0]) == block(0)
    assert client.pttl(name) > 90_000  # used: it lives on
    client.pexpireat(name, 1)  # the server expires it
    assert store.get(KEYS[0]) is None and not store.contains(KEYS[0])
    assert store.stats().expired == 0  # not visible to the client
    RedisStore(server.url, ttl_s=0.25).put(KEYS[1], block(1))
    assert 0 < client.pttl(DEFAULT_PREFIX + KEYS[1]) <= 250  # milliseconds: a fractional TTL holds
    RedisStore(server.url).put(KEYS[2], block(2))
    assert client.ttl(DEFAULT_PREFIX + KEYS[2]) == -1  # no ttl_s: no expiry
    assert RedisStore(server.url).get(KEYS[2]) == block(2) and client.ttl(DEFAULT_PREFIX + KEYS[2]) == -1


def test_a_damaged_entry_is_a_miss_deleted_and_counted(server, caplog):
    client = server.client()
    store = RedisStore(server.url)
    client.set(DEFAULT_PREFIX + KEYS[0], b"garbage, not a block")
    client.set(DEFAULT_PREFIX + KEYS[1], block(1)[:-5])  # truncated
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert store.get(KEYS[0]) is None and store.get(KEYS[1]) is None
    assert client.exists(DEFAULT_PREFIX + KEYS[0], DEFAULT_PREFIX + KEYS[1]) == 0
    stats = store.stats()
    assert (stats.corrupt, stats.misses, stats.hits, stats.errors) == (2, 2, 0, 0)
    assert len(caplog.records) == 2 and "damaged" in caplog.records[0].getMessage()


def test_a_killed_server_degrades_then_is_used_again_after_the_backoff(own_server, caplog):
    clock = Clock()
    store = RedisStore(own_server.url, backoff_s=1, max_backoff_s=4, clock=clock)
    assert store.put(KEYS[0], block(0))
    sent = []  # the commands that went to the network
    send = store._client.execute_command

    def counted(*args, **kwargs):
        sent.append(args[0])
        return send(*args, **kwargs)

    store._client.execute_command = counted
    own_server.kill()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert store.get(KEYS[0]) is None  # fails: the store goes down, retried after 1 s
        assert store.put(KEYS[1], block(1)) is False and not store.contains(KEYS[0]) and not store.delete(KEYS[0])  # skipped
        assert len(sent) == 1 and store.stats().errors == 4
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "\n" not in warnings[0]
        assert store.url in warnings[0] and "ConnectionError" in warnings[0] and "down" in warnings[0]

        clock.now += 1
        assert store.get(KEYS[0]) is None and len(sent) == 2  # one try, failed: the next after 2 s
        clock.now += 1.5
        assert store.get(KEYS[0]) is None and len(sent) == 2
        clock.now += 0.5
        assert store.get(KEYS[0]) is None and len(sent) == 3  # failed again: the next after 4 s
        clock.now += 4
        assert store.get(KEYS[0]) is None and len(sent) == 4  # and again: still 4 s (max_backoff_s)

        own_server.start()  # the same port, empty
        clock.now += 3.5
        assert store.put(KEYS[1], block(1)) is False and len(sent) == 4  # still backing off
        clock.now += 0.5
        assert store.put(KEYS[1], block(1)) is True and len(sent) == 5
        assert store.get(KEYS[1]) == block(1) and store.get(KEYS[0]) is None  # the old server's entries are gone
    levels = [r.levelno for r in caplog.records]
    assert levels == [logging.WARNING, logging.INFO] and "works again" in caplog.records[1].getMessage()
    stats = store.stats()
    assert (stats.errors, stats.stores, stats.hits, stats.misses) == (9, 2, 1, 6)


def test_a_server_that_never_answers_times_out(caplog):
    need(redis_server=False)
    with socket.socket() as silent:  # listens (the kernel completes connects) and never replies
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        store = RedisStore(f"redis://127.0.0.1:{silent.getsockname()[1]}/0", timeout_s=0.2)
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            assert store.get(KEYS[0]) is None
    assert store.stats().errors == 1 and "Timeout" in caplog.records[0].getMessage()


def test_a_refused_command_fails_that_call_without_backing_off(server, caplog):
    client = server.client()
    store = RedisStore(server.url, clock=Clock())
    client.rpush(DEFAULT_PREFIX + KEYS[0], b"a list, not a string")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert store.get(KEYS[0]) is None and store.get(KEYS[0]) is None
        assert store.put(KEYS[1], block(1))  # no backoff: the server works
        client.config_set("maxmemory-policy", "noeviction")
        client.config_set("maxmemory", 1)
        try:
            assert store.put(KEYS[2], block(2)) is False and store.put(KEYS[3], block(3)) is False
            assert store.get(KEYS[1]) == block(1)
        finally:
            client.config_set("maxmemory", 0)
        assert store.put(KEYS[2], block(2))
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2 and "WRONGTYPE" in messages[0] and "OutOfMemoryError" in messages[1]  # once per kind
    stats = store.stats()
    assert (stats.errors, stats.stores, stats.hits) == (4, 2, 1)


def test_too_large_a_value_is_rejected_without_a_call():
    need(redis_server=False)
    store = RedisStore("redis://127.0.0.1:1/0", max_value_bytes=100)  # nothing listens there: a call would count an error
    assert store.put(KEYS[0], bytes(101)) is False
    assert (store.stats().rejected, store.stats().errors) == (1, 0)


def test_stores_and_processes_share_entries(server):
    one, two = RedisStore(server.url), RedisStore(server.url)
    one.put(KEYS[0], block(0))
    assert two.get(KEYS[0]) == block(0)
    assert two.delete(KEYS[0]) and one.get(KEYS[0]) is None
    assert RedisStore(server.url, prefix="other:").get(KEYS[0]) is None
    writer = "import sys\nfrom deepinfer.kv_tiers.redis_store import RedisStore\nprint(RedisStore(sys.argv[1]).put(sys.argv[2], bytes.fromhex(sys.argv[3])))\n"
    proc = subprocess.run([sys.executable, "-c", writer, server.url, KEYS[1], block(1).hex()], capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == 0 and proc.stdout.strip() == "True", proc.stderr
    assert one.get(KEYS[1]) == block(1)


def test_threads_share_one_store(server):
    store = RedisStore(server.url)
    wrong = []  # an assert in a thread would only warn

    def work(t: int) -> None:
        for i in range(50):
            j = (t + i) % 8
            if not store.put(KEYS[j], block(j)) or store.get(KEYS[(j + 1) % 8]) not in (None, block((j + 1) % 8)):
                wrong.append((t, i))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=HANG_S)
    stats = store.stats()
    assert not wrong and (stats.stores, stats.hits + stats.misses, stats.errors, stats.corrupt) == (400, 400, 0, 0)


def test_open_store_opens_redis_valkey_and_unix_socket_urls(server):
    store = open_store(f"redis://127.0.0.1:{server.port}/0?ttl_s=60&prefix=kv:")
    assert isinstance(store, RedisStore) and (store.ttl_s, store.prefix) == (60.0, "kv:")
    assert store.put(KEYS[0], block(0)) and 0 < server.client().ttl(f"kv:{KEYS[0]}") <= 60
    valkey = open_store(f"valkey://127.0.0.1:{server.port}/0?prefix=kv:", timeout_s=2)
    assert valkey.timeout_s == 2 and valkey.get(KEYS[0]) == block(0)
    assert open_store(f"redis://127.0.0.1:{server.port}/0?ttl_s=60", ttl_s=5).ttl_s == 5  # keyword arguments win
    assert open_store(f"redis://127.0.0.1:{server.port}/1?prefix=kv:").get(KEYS[0]) is None  # another database
    assert RedisStore(f"unix://{server.socket}?db=0&prefix=kv:").get(KEYS[0]) == block(0)


@pytest.mark.parametrize(
    ("url", "options", "match"),
    [
        ("http://h:6379/0", {}, "redis://host:6379/0, rediss://"),
        ("redis://h:port/0", {}, "port is not a number"),
        ("redis://h:6379/zero", {}, "database number"),
        ("redis://h:6379/0?colour=red", {}, "unknown option 'colour'"),
        ("redis://h:6379/0?size=1GiB", {}, "unknown option 'size'"),
        ("redis://h:6379/0?ttl_s=-1", {}, "ttl_s is a positive number"),
        ("redis://h:6379/0?ttl_s=soon", {}, "ttl_s is a positive number"),
        ("redis://h:6379/0", {"ttl_s": 0}, "ttl_s is a positive number"),
        ("redis://h:6379/0?timeout_s=0", {}, "timeout_s"),
        ("redis://h:6379/0?max_value_bytes=lots", {}, "not a size"),
        ("redis://h:6379/0", {"prefix": 3}, "prefix is a string"),
        ("unix://", {}, "socket's path"),
        ("redis://h:6379?db=zero", {}, "Invalid value for 'db'"),
    ],
)
def test_bad_urls_and_options_are_one_line_value_errors(url, options, match):
    if "db=" in url:
        need(redis_server=False)  # redis-py reads db=
    with_password = url.replace("://", f"://:{PASSWORD}@", 1) if url != "unix://" else url
    for opener in (RedisStore, open_store):
        if opener is open_store and not url.startswith(("redis", "valkey")):
            continue
        with pytest.raises(ValueError, match=match) as e:
            opener(with_password, **options)
        assert "\n" not in str(e.value) and PASSWORD not in str(e.value)


def test_the_password_is_used_and_never_shown(tmp_path, caplog):
    need()
    server = RedisServer(tmp_path, "--requirepass", PASSWORD)
    try:
        with caplog.at_level(logging.INFO, logger=LOGGER):
            store = RedisStore(f"redis://:{PASSWORD}@127.0.0.1:{server.port}/0")
            assert store.put(KEYS[0], block(0)) and store.get(KEYS[0]) == block(0)
            by_query = RedisStore(f"redis://127.0.0.1:{server.port}/0?password={PASSWORD}")
            assert by_query.get(KEYS[0]) == block(0)
            assert "password=***" in repr(by_query) and ":***@" in repr(store)
            wrong = RedisStore(f"redis://default:{PASSWORD}-wrong@127.0.0.1:{server.port}/0")
            assert wrong.get(KEYS[0]) is None and wrong.stats().errors == 1
        for shown in (repr(store), repr(by_query), repr(wrong), store.url, by_query.url, wrong.url, *(r.getMessage() for r in caplog.records)):
            assert PASSWORD not in shown, shown
        assert len(caplog.records) == 1 and "AuthenticationError" in caplog.records[0].getMessage()
    finally:
        server.kill()


def test_redact():
    assert redact("redis://user:pw@h:1/0") == "redis://user:***@h:1/0"
    assert redact("rediss://:pw@h") == "rediss://:***@h"
    assert redact("redis://h/0?db=1&password=pw&ttl_s=3") == "redis://h/0?db=1&password=***&ttl_s=3"
    assert redact("redis://user@h/0") == "redis://user@h/0"  # a user name alone is no secret


def test_missing_redis_py_names_the_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "redis", None)  # as if not installed: `import redis` raises ImportError
    for opener in (RedisStore, open_store):
        with pytest.raises(ImportError, match=r"pip install 'deepinfer\[redis\]'") as e:
            opener("redis://127.0.0.1:6379/0")
        assert "\n" not in str(e.value)


def test_engines_share_blocks_through_the_store(server):
    """A second engine (another process, as far as the store can tell) finds the first one's blocks in Redis, and its
    greedy tokens are those of a run without tiers."""
    import torch

    from deepinfer import LLM, SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    batch = [{"prompt_token_ids": torch.randint(0, 1000, (70,), generator=g).tolist()} for _ in range(3)]

    def engine(**tiers):
        return LLM(model="tiny-v3", backend="reference", num_kv_blocks=20, max_num_seqs=2, announce=False, **tiers)

    want = [o.outputs[0].token_ids for o in engine().generate(batch, greedy, use_tqdm=False)]
    first = engine(kv_store_url=server.url)
    assert [o.outputs[0].token_ids for o in first.generate(batch, greedy, use_tqdm=False)] == want
    assert first.kv_tier_stats()["store"]["stores"] == 12
    second = engine(kv_store_url=server.url)
    outs = second.generate(batch, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want and [o.num_cached_tokens for o in outs] == [64] * 3
    assert second.kv_tier_stats()["store"]["hit_blocks"] == 12


def test_an_unreachable_store_degrades_to_recomputing(caplog):
    """A shared store nobody answers at: generation goes on with the tiers that work (none here), its tokens those
    of a run without tiers, one warning line, the errors counted."""
    from deepinfer import LLM, SamplingParams

    need(redis_server=False)
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    batch = [{"prompt_token_ids": torch.randint(0, 1000, (40,), generator=torch.Generator().manual_seed(i)).tolist()} for i in range(3)]

    def engine(**tiers):
        return LLM(model="tiny-v3", backend="reference", num_kv_blocks=20, max_num_seqs=2, announce=False, **tiers)

    want = [o.outputs[0].token_ids for o in engine().generate(batch, greedy, use_tqdm=False)]
    llm = engine(kv_store_url=f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        outs = llm.generate(batch, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    store = llm.kv_tier_stats()["store"]
    assert store["errors"] >= 1 and store["hit_blocks"] == 0 and store["stores"] == 0
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
