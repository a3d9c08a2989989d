"""open_store: stores are plugins of the entry-point group "deepinfer.kv_stores", chosen by URL scheme."""

from __future__ import annotations

from importlib.metadata import EntryPoint

import pytest

from deepinfer.kv_tiers import disk_store, host_store, open_store
from deepinfer.kv_tiers.disk_store import DiskStore
from deepinfer.kv_tiers.host_store import HostStore
from deepinfer.kv_tiers.open_store import ENTRY_POINT_GROUP, parse_size, store_factories


def test_the_entry_point_group_resolves_the_built_in_stores():
    found = store_factories()
    assert {"file", "host"} <= set(found)
    assert found["file"].load() is disk_store.open_url
    assert found["host"].load() is host_store.open_url


def test_file_urls_open_a_disk_store(tmp_path):
    store = open_store.open_store(f"file://{tmp_path}/kv?size=2MiB&ttl_s=60")
    assert isinstance(store, DiskStore)
    assert (store.root, store.capacity_bytes, store.ttl_s) == (tmp_path / "kv", 2 << 20, 60.0)
    store = open_store.open_store(f"file://{tmp_path}/kv", capacity_bytes="1GB", ttl_s=5)  # keyword arguments win
    assert (store.capacity_bytes, store.ttl_s) == (10**9, 5)
    with pytest.raises(ValueError, match="needs a size"):
        open_store.open_store(f"file://{tmp_path}/kv")
    with pytest.raises(ValueError, match="three slashes"):
        open_store.open_store("file://somehost/kv?size=1")
    with pytest.raises(ValueError, match="unknown option 'colour'"):
        open_store.open_store(f"file://{tmp_path}/kv?size=1&colour=red")


@pytest.mark.parametrize(("url", "size"), [("host://16MiB", 16 << 20), ("host://?size=1KB", 1000), ("4GiB", 4 << 30), ("host://", 7)])
def test_host_urls_and_bare_sizes_open_a_host_store(url, size):
    store = open_store.open_store(url, capacity_bytes=7) if url == "host://" else open_store.open_store(url)
    assert isinstance(store, HostStore) and store.capacity_bytes == size


def test_an_unknown_scheme_is_one_line_naming_the_known_ones_and_the_group():
    with pytest.raises(ValueError) as e:
        open_store.open_store("memcached://cache:11211")
    message = str(e.value)
    assert "\n" not in message
    assert "file://" in message and "host://" in message and ENTRY_POINT_GROUP in message and "'memcached://cache:11211'" in message


def test_a_third_party_store_plugs_in_by_entry_point(monkeypatch):
    toy = EntryPoint(name="toy", value="deepinfer.kv_tiers.host_store:open_url", group=ENTRY_POINT_GROUP)
    real = open_store.entry_points_of
    monkeypatch.setattr(open_store, "entry_points_of", lambda group: [*real(group), toy])
    assert isinstance(open_store.open_store("toy://1KiB"), HostStore)
    broken = EntryPoint(name="broken", value="no_such_module_here:open_url", group=ENTRY_POINT_GROUP)
    monkeypatch.setattr(open_store, "entry_points_of", lambda group: [broken])
    with pytest.raises(ValueError, match="failed to load"):
        open_store.open_store("broken://x")


def test_parse_size():
    assert [parse_size(s) for s in ("123", "1k", "1KiB", "1.5GB", "2TiB", 5)] == [123, 1000, 1024, 1_500_000_000, 2 << 40, 5]
    with pytest.raises(ValueError, match="not a size"):
        parse_size("lots")
