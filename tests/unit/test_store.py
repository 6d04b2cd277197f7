"""The coordination store in one process: the fast part of the contract suite
(store_contract) on an :class:`EmbeddedStore` on a fresh file, opening stores by URL, and
what only the embedded store does. The contract on etcd, the tests that wait out leases,
and those with several processes or an etcd that goes away are in tests/integration.
"""

from __future__ import annotations

import sqlite3
import uuid
from pathlib import Path

import pytest
from store_contract import (
    Backend,
    Recorder,
    ns,
    other,
    store,
    test_a_lease_is_usable_by_another_client,
    test_compare_and_set,
    test_compare_and_set_with_lease,
    test_election,
    test_get_prefix,
    test_get_prefix_reads_a_thousand_hosts_at_once,
    test_put_get_delete,
    test_revoke_deletes_the_keys_of_a_lease,
    test_watch_callback_may_use_the_store,
    test_watch_prefix_sees_puts_and_deletes_in_order,
)

from launcher.errors import ConfigError, StoreError
from launcher.store import PRIVATE_SEGMENT, open_store
from launcher.store.embedded import EmbeddedStore

__all__ = [  # the contract's fixtures and tests (store_contract), found by name
    "ns", "other", "store",
    "test_a_lease_is_usable_by_another_client", "test_compare_and_set",
    "test_compare_and_set_with_lease", "test_election", "test_get_prefix",
    "test_get_prefix_reads_a_thousand_hosts_at_once", "test_put_get_delete",
    "test_revoke_deletes_the_keys_of_a_lease", "test_watch_callback_may_use_the_store",
    "test_watch_prefix_sees_puts_and_deletes_in_order",
]


@pytest.fixture(params=["embedded"])
def backend(tmp_path: Path) -> Backend:
    return Backend("embedded", f"embedded://{tmp_path / 'store.db'}")


# -- opening stores by URL --------------------------------------------------------------------
def test_open_store_urls(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as unknown:
        open_store("redis://localhost:6379")
    assert "etcd://" in str(unknown.value) and "embedded://" in str(unknown.value)
    for bad in ("etcd://", "etcd://host:notaport", "etcd://host:99999", "embedded://relative/x.db",
                "https://x", "", "etcd:/x"):
        with pytest.raises(ConfigError):
            open_store(bad)
    with pytest.raises(ConfigError):
        open_store("embedded://")  # no default path given
    default = open_store("embedded://", default_path=tmp_path / "deep" / "default.db")
    assert isinstance(default, EmbeddedStore)
    default.put("k", b"v")
    default.close()
    explicit = open_store(f"embedded://{tmp_path / 'deep' / 'default.db'}")
    assert explicit.get("k") == b"v"
    explicit.close()


def test_embedded_store_in_an_unusable_place_raises_store_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(StoreError):
        open_store(f"embedded://{blocker / 'store.db'}")
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"this is not a database" * 100)
    with pytest.raises(StoreError):
        open_store(f"embedded://{garbage}")


def test_embedded_store_keeps_private_values_out_of_its_change_log(tmp_path: Path) -> None:
    """A secret under a private key is in the key table only; once deleted, its bytes are
    nowhere in the store's files. The store refuses a file of another kind or a symlink."""
    path = tmp_path / "store.db"
    store = open_store(f"embedded://{path}")
    secret, public = uuid.uuid4().hex.encode(), uuid.uuid4().hex.encode()
    seen = Recorder()
    store.watch_prefix("run/", seen)
    store.compare_and_set(f"run/{PRIVATE_SEGMENT}", None, secret)
    store.put("run/public", public)
    assert store.get(f"run/{PRIVATE_SEGMENT}") == secret
    assert seen.wait_for(2) == [(f"run/{PRIVATE_SEGMENT}", b""), ("run/public", public)]
    db = sqlite3.connect(path)
    logged = [bytes(v) for (v,) in db.execute("SELECT value FROM events")]
    db.close()
    assert logged == [b"", public]
    store.delete(f"run/{PRIVATE_SEGMENT}")
    store.close()
    assert [p.name for p in tmp_path.iterdir() if public in p.read_bytes()] == ["store.db"]
    assert [p.name for p in tmp_path.iterdir() if secret in p.read_bytes()] == []
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    link = tmp_path / "link.db"
    link.symlink_to(path)
    with pytest.raises(StoreError, match="cannot open the embedded store"):
        open_store(f"embedded://{link}")
