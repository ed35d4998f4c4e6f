"""Host pool against a naive LRU, disk tier crash safety, config errors."""

from __future__ import annotations

import stat

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.engine.engine_config import EngineConfig
from shared.engine.kv.disk_tier import DiskTier
from shared.engine.kv.hicache_config import HiCacheConfig
from shared.engine.kv.host_pool import HostPagePool
from shared.model.fingerprint import weights_fingerprint
from tests.engine.tiny import tiny_model

PAYLOAD = bytes(range(256)) * 4


def test_disk_round_trip_and_restart(tmp_path):
    disk = DiskTier(tmp_path)
    disk.add(b"a" * 16)
    disk.write_file(b"a" * 16, PAYLOAD)
    assert disk.read_file(b"a" * 16, len(PAYLOAD)) == PAYLOAD
    (tmp_path / "61" / "junk.kv.tmp").write_bytes(b"half")  # a crash mid-write leaves this
    restarted = DiskTier(tmp_path)
    assert b"a" * 16 in restarted and len(restarted) == 1
    assert not (tmp_path / "61" / "junk.kv.tmp").exists()


def test_a_page_another_model_wrote_under_the_same_name_reads_as_a_miss(tmp_path):
    """Found in review: page names hash tokens only and the digest had no key, so a fine-tune
    sharing the directory would have had its pages read as this model's KV."""
    ours, theirs = DiskTier(tmp_path, namespace=b"model A"), DiskTier(tmp_path, namespace=b"model B")
    theirs.write_file(b"a" * 16, PAYLOAD)
    assert ours.read_file(b"a" * 16, len(PAYLOAD)) is None  # refused, and deleted
    ours.write_file(b"a" * 16, PAYLOAD)
    assert DiskTier(tmp_path, namespace=b"model A").read_file(b"a" * 16, len(PAYLOAD)) == PAYLOAD


def test_the_weights_fingerprint_tells_checkpoints_of_one_shape_apart():
    a, b = tiny_model(seed=1), tiny_model(seed=2)
    assert weights_fingerprint(a) == weights_fingerprint(tiny_model(seed=1)) != weights_fingerprint(b)


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty"])
def test_torn_write_reads_as_miss_and_is_deleted(tmp_path, damage):
    disk = DiskTier(tmp_path)
    key = b"k" * 16
    disk.write_file(key, PAYLOAD)
    path = disk.path_of(key)
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[: len(data) - 100]
    elif damage == "flip":
        data[-1] ^= 0xFF
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    assert disk.read_file(key, len(PAYLOAD)) is None
    assert not path.exists()


def test_disk_keeps_max_pages_lru(tmp_path):
    disk = DiskTier(tmp_path, max_pages=2)
    assert disk.add(b"1" * 16) == [] and disk.add(b"2" * 16) == []
    disk.touch(b"1" * 16)
    assert disk.add(b"3" * 16) == [b"2" * 16]


ops = st.lists(st.tuples(st.sampled_from(["alloc", "lookup", "lock", "unlock", "discard"]), st.integers(0, 7)),
               max_size=60)


@settings(max_examples=80, deadline=None)
@given(num_pages=st.integers(1, 4), ops=ops)
def test_host_pool_matches_naive_lru(num_pages, ops):
    pool = HostPagePool(num_pages)
    lru: list[bytes] = []  # naive reference: keys, oldest first
    locked: dict[bytes, int] = {}  # locks by key while keyed
    page_of: dict[bytes, int] = {}
    for op, i in ops:
        key = bytes([i]) * 16
        if op == "alloc" and key not in lru:
            victims = [k for k in lru if not locked.get(k)]
            alloc = pool.allocate(key)
            if len(page_of) + sum(1 for p in pool._orphans) < num_pages:
                assert alloc is not None and alloc.evicted is None
            elif victims:
                assert alloc is not None and alloc.evicted == victims[0]
                lru.remove(victims[0])
                page_of.pop(victims[0])
            else:
                assert alloc is None
            if alloc is not None:
                lru.append(key)
                page_of[key] = alloc.page
        elif op == "lookup":
            assert pool.lookup(key) == page_of.get(key)
            if key in lru:
                lru.remove(key)
                lru.append(key)
        elif op == "lock" and key in page_of:
            pool.lock(page_of[key])
            locked[key] = locked.get(key, 0) + 1
        elif op == "unlock" and locked.get(key):
            pool.unlock(page_of[key])
            locked[key] -= 1
        elif op == "discard" and key in page_of:
            pool.discard(key)
            lru.remove(key)
            page = page_of.pop(key)
            for _ in range(locked.pop(key, 0)):
                pool.unlock(page)
        assert [k for k in pool._by_hash] == lru
        pool.check_integrity()


@pytest.mark.parametrize("bad, key", [
    ({"write_policy": "write_sometimes"}, "write_policy"),
    ({"write_through_threshold": 0}, "write_through_threshold"),
    ({"host_pool_mb": 0}, "host_pool_mb"),
    ({"disk_max_mb": -1}, "disk_max_mb"),
    ({"disk_max_mb": 0}, "disk_max_mb"),  # found in review: 0 meant unbounded (992 MB after 50k prompt tokens)
    ({"min_load_tokens": -5}, "min_load_tokens"),
])
def test_bad_config_names_the_key(bad, key):
    with pytest.raises(ValueError, match=key):
        HiCacheConfig(**bad)


def test_tiers_need_the_radix_tree():
    with pytest.raises(ValueError, match="hicache"):
        EngineConfig(prefix_index="hashed", hicache=HiCacheConfig(enabled=True))


def test_page_files_are_private_to_the_daemon_s_user(tmp_path):
    """Found in review: page files were 0644 in 0755 directories: anyone local read the KV of
    the fleet's prompts."""
    root = tmp_path / "disk"
    root.mkdir(mode=0o755)
    disk = DiskTier(root)
    disk.write_file(b"\x01" * 16, b"payload")
    path = disk.path_of(b"\x01" * 16)
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_stray_names_and_symlinks_do_not_stop_the_tier_from_starting(tmp_path):
    """Found in review: one non-hex ``*.kv`` name or a broken symlink made DiskTier() raise."""
    disk = DiskTier(tmp_path)
    page = b"\x02" * 16
    disk.write_file(page, b"payload")
    (tmp_path / "zz").mkdir()
    (tmp_path / "zz" / ("not-hex-at-all-but-32-chars-long" + ".kv")).write_bytes(b"x")
    (tmp_path / "02" / "broken.kv").symlink_to(tmp_path / "missing")
    (tmp_path / "02" / ("02" * 15 + "ab.kv")).symlink_to(disk.path_of(page))  # a page name, but a link
    restarted = DiskTier(tmp_path)
    assert page in restarted and len(restarted) == 1
