"""The contract tests (store_contract) that wait out leases, a few seconds each, on an
:class:`EmbeddedStore` on a fresh file; the rest of the contract on it is in
tests/unit/test_store.py, and the whole contract on etcd in tests/integration/test_store.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from store_contract import (
    Backend,
    ns,
    other,
    store,
    test_close_stops_keep_alives_and_watches,
    test_election_fails_over_when_the_leader_stops_refreshing,
    test_keep_alive_keeps_a_lease_until_stopped,
    test_lease_expires,
    test_watch_sees_lease_expiry_as_delete,
)

__all__ = [  # the contract's fixtures and tests (store_contract), found by name
    "ns", "other", "store",
    "test_close_stops_keep_alives_and_watches",
    "test_election_fails_over_when_the_leader_stops_refreshing",
    "test_keep_alive_keeps_a_lease_until_stopped", "test_lease_expires",
    "test_watch_sees_lease_expiry_as_delete",
]


@pytest.fixture(params=["embedded"])
def backend(tmp_path: Path) -> Backend:
    return Backend("embedded", f"embedded://{tmp_path / 'store.db'}")
