"""The coordination store in one SQLite file (``embedded:///PATH.db``), the default for
single-host runs: see :mod:`launcher.store`."""

from __future__ import annotations

import logging
import os
import sqlite3
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from launcher.errors import ConfigError, StoreError
from launcher.store import (
    PRIVATE_SEGMENT,
    KeepAlive,
    Lease,
    StoreLease,
    Watch,
    WatchCallback,
    _check_key,
    _check_ttl,
    _prefix_end,
    _StoreBase,
)

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS kv (key BLOB PRIMARY KEY, value BLOB NOT NULL, lease INTEGER,"
    " revision INTEGER NOT NULL) WITHOUT ROWID",
    "CREATE INDEX IF NOT EXISTS kv_lease ON kv (lease) WHERE lease IS NOT NULL",
    "CREATE TABLE IF NOT EXISTS leases (id INTEGER PRIMARY KEY AUTOINCREMENT, ttl REAL NOT NULL,"
    " expires REAL NOT NULL)",
    "CREATE INDEX IF NOT EXISTS leases_expires ON leases (expires)",
    # The change log that watches poll: value NULL is a delete.
    "CREATE TABLE IF NOT EXISTS events (revision INTEGER PRIMARY KEY, key BLOB NOT NULL,"
    " value BLOB, time REAL NOT NULL)",
    # 'revision': the latest change; 'trimmed': the latest change no longer in the log.
    "CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value INTEGER NOT NULL)",
    "INSERT OR IGNORE INTO meta (name, value) VALUES ('revision', 0), ('trimmed', 0)",
)

#: A key is visible if it has no lease or its lease has not expired (parameter: now).
_VISIBLE = "(lease IS NULL OR lease IN (SELECT id FROM leases WHERE expires > ?))"

_PRIVATE = PRIVATE_SEGMENT.encode()

#: The files SQLite keeps beside the database; the WAL and the shared-memory index hold
#: copies of its pages (the run's secret among them), the journal too before WAL mode.
_SIDE_FILES = ("-wal", "-shm", "-journal")

#: Seconds the change log keeps events for watchers (a watcher polls every 50 ms).
EVENT_RETENTION = 600.0
_TRIM_EVERY = 30.0


class EmbeddedStore(_StoreBase):
    """A :class:`Store` in one SQLite file, shared by every process on the host that
    opens it.

    The file is in WAL mode, so readers never wait for a writer; every change is one
    ``BEGIN IMMEDIATE`` transaction, so compare-and-set is atomic across processes. Each
    change gets the next revision and is appended to a change log that watches poll every
    ``poll_interval`` seconds. Leases are expiry times on the wall clock: a key whose
    lease has expired is invisible at once and is deleted (with a delete event) by the
    next change or watch poll. ``timeout`` bounds how long a call waits for the file's
    lock.
    """

    def __init__(self, path: str | os.PathLike[str], *, timeout: float = 5.0,
                 poll_interval: float = 0.05) -> None:
        if not timeout > 0:
            raise ConfigError(f"store timeout must be positive, not {timeout!r}")
        self.path = Path(path)
        self.timeout = timeout
        self.poll_interval = poll_interval
        self._lock = threading.RLock()
        self._closed = False
        self._watches: list[_EmbeddedWatch] = []
        self._keepalives: list[KeepAlive] = []
        self._last_trim = 0.0
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # SQLite opens its side files by name with O_CREAT and no check of their owner:
            # one another user made first (in a directory others can write) would receive
            # the pages of the database. Create them first, as files of this user, and
            # check them again once SQLite holds them open.
            for path in (self.path, *self._side_files()):
                self._claim(path, create=not path.name.endswith("-journal"))
            self._db: sqlite3.Connection = self._connect()
            try:
                for path in self._side_files():
                    self._claim(path, create=False)
            except BaseException:
                self._db.close()
                raise
        except (OSError, sqlite3.Error) as exc:
            raise StoreError(f"cannot open the embedded store {self.path}: "
                             f"{getattr(exc, 'strerror', None) or exc}") from exc
        try:
            self._write("open", self._create_schema, maintain=False)
        except StoreError:
            self.close()
            raise

    def __repr__(self) -> str:
        return f"EmbeddedStore({str(self.path)!r})"

    def _side_files(self) -> list[Path]:
        return [self.path.with_name(self.path.name + suffix) for suffix in _SIDE_FILES]

    @staticmethod
    def _claim(path: Path, *, create: bool) -> None:
        """Check that ``path`` is a regular file of this user, not a link; with ``create``,
        make it (mode 0600) if missing. StoreError if it is another user's or not a file:
        it would hold the run's secret.

        An existing file is only looked at (``lstat``), never opened: closing a descriptor
        drops every POSIX lock this process holds on the file, SQLite's among them, and
        another process would then reset the shared-memory index under us (SIGBUS)."""
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            if not create:
                return
            try:
                os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                                 | os.O_CLOEXEC, 0o600))
                return
            except FileExistsError:  # another process made it meanwhile: check theirs
                info = os.lstat(path)
        why = ("a symbolic link" if stat.S_ISLNK(info.st_mode)
               else "not a regular file" if not stat.S_ISREG(info.st_mode)
               else f"owned by uid {info.st_uid}" if info.st_uid != os.geteuid()
               else None)
        if why is not None:
            raise StoreError(f"cannot open the embedded store {path}: {why}, not a file of "
                             "this user (it would hold the run's secret); remove it or keep "
                             "the store in a directory only you can write")

    @staticmethod
    def _create_schema(db: sqlite3.Connection, now: float) -> None:
        for statement in _SCHEMA:
            db.execute(statement)

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, timeout=self.timeout, isolation_level=None,
                             check_same_thread=False)
        try:
            # Switching a new file to WAL takes an exclusive lock and SQLite answers "locked"
            # at once, without its busy handler, while another process does the same.
            deadline = time.monotonic() + self.timeout
            while True:
                try:
                    mode = db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
                    break
                except sqlite3.OperationalError as exc:
                    if "locked" not in str(exc) or time.monotonic() > deadline:
                        raise
                    time.sleep(0.02)
            if str(mode).lower() != "wal":
                logger.warning("%s is not in WAL mode (%s): readers will wait for writers",
                               self.path, mode)
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute("PRAGMA secure_delete=ON")  # a deleted secret leaves no bytes behind
        except sqlite3.Error:
            db.close()
            raise
        return db

    # -- the edge: every SQLite call goes through here -------------------------------------
    def _read(self, what: str, sql: str, args: tuple[Any, ...]) -> list[Any]:
        with self._lock:
            if self._closed:
                raise StoreError(f"{what}: the embedded store is closed")
            try:
                return self._db.execute(sql, args).fetchall()
            except sqlite3.Error as exc:
                raise StoreError(f"embedded store {what} failed ({self.path}): {exc}") from exc

    def _write(self, what: str, fn: Callable[[sqlite3.Connection, float], _T], *,
               maintain: bool = True) -> _T:
        """Run ``fn(db, now)`` in one write transaction; with ``maintain``, first delete the
        keys of expired leases and now and then trim the change log."""
        with self._lock:
            if self._closed:
                raise StoreError(f"{what}: the embedded store is closed")
            db = self._db
            try:
                db.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as exc:
                raise StoreError(f"embedded store {what} failed ({self.path}): {exc}") from exc
            try:
                now = time.time()  # after taking the lock: expiry decisions are ordered
                if maintain:
                    self._purge(db, now)
                result = fn(db, now)
                if maintain:
                    self._trim(db, now)
                db.execute("COMMIT")
            except BaseException as exc:
                try:
                    db.execute("ROLLBACK")
                except sqlite3.Error:
                    pass  # the failed statement already ended the transaction
                if isinstance(exc, sqlite3.Error):
                    raise StoreError(
                        f"embedded store {what} failed ({self.path}): {exc}") from exc
                raise
            return result

    @staticmethod
    def _record(db: sqlite3.Connection, key: bytes, value: bytes | None, now: float) -> int:
        """Take the next revision and log the change under it (a private key's value
        stays out of the log)."""
        if value is not None and key.rsplit(b"/", 1)[-1] == _PRIVATE:
            value = b""
        db.execute("UPDATE meta SET value = value + 1 WHERE name = 'revision'")
        (revision,) = db.execute("SELECT value FROM meta WHERE name = 'revision'").fetchone()
        db.execute("INSERT INTO events (revision, key, value, time) VALUES (?, ?, ?, ?)",
                   (revision, key, value, now))
        return int(revision)

    def _drop_lease(self, db: sqlite3.Connection, lease_id: int, now: float) -> None:
        keys = db.execute("SELECT key FROM kv WHERE lease = ? ORDER BY key",
                          (lease_id,)).fetchall()
        for (key,) in keys:
            self._record(db, key, None, now)
        db.execute("DELETE FROM kv WHERE lease = ?", (lease_id,))
        db.execute("DELETE FROM leases WHERE id = ?", (lease_id,))

    def _purge(self, db: sqlite3.Connection, now: float) -> None:
        for (lease_id,) in db.execute("SELECT id FROM leases WHERE expires <= ? ORDER BY expires",
                                      (now,)).fetchall():
            self._drop_lease(db, lease_id, now)

    def _trim(self, db: sqlite3.Connection, now: float) -> None:
        if now - self._last_trim < _TRIM_EVERY:
            return
        self._last_trim = now
        (last,) = db.execute("SELECT MAX(revision) FROM events WHERE time < ?",
                             (now - EVENT_RETENTION,)).fetchone()
        if last is not None:
            db.execute("DELETE FROM events WHERE revision <= ?", (last,))
            db.execute("UPDATE meta SET value = MAX(value, ?) WHERE name = 'trimmed'", (last,))

    # -- keys ------------------------------------------------------------------------------
    def get(self, key: str) -> bytes | None:
        rows = self._read("get", f"SELECT value FROM kv WHERE key = ? AND {_VISIBLE}",
                          (_check_key(key), time.time()))
        return bytes(rows[0][0]) if rows else None

    def put(self, key: str, value: bytes, *, lease: Lease | None = None) -> None:
        k, v = _check_key(key), bytes(value)

        def put(db: sqlite3.Connection, now: float) -> None:
            lease_id = self._live_lease(db, lease)
            revision = self._record(db, k, v, now)
            db.execute("INSERT OR REPLACE INTO kv (key, value, lease, revision) "
                       "VALUES (?, ?, ?, ?)", (k, v, lease_id, revision))

        self._write("put", put)

    @staticmethod
    def _live_lease(db: sqlite3.Connection, lease: Lease | None) -> int | None:
        """The lease's id, after checking it still lives (expired ones are purged)."""
        if lease is None:
            return None
        if db.execute("SELECT 1 FROM leases WHERE id = ?", (lease.id,)).fetchone() is None:
            raise StoreError(f"lease {lease.id:x} has expired or was revoked")
        return lease.id

    def compare_and_set(self, key: str, expected: bytes | None, value: bytes, *,
                        lease: Lease | None = None) -> bool:
        k, v = _check_key(key), bytes(value)

        def cas(db: sqlite3.Connection, now: float) -> bool:
            row = db.execute("SELECT value FROM kv WHERE key = ?", (k,)).fetchone()
            current = None if row is None else bytes(row[0])
            if current != (None if expected is None else bytes(expected)):
                return False
            lease_id = self._live_lease(db, lease)
            revision = self._record(db, k, v, now)
            db.execute("INSERT OR REPLACE INTO kv (key, value, lease, revision) "
                       "VALUES (?, ?, ?, ?)", (k, v, lease_id, revision))
            return True

        return self._write("compare-and-set", cas)

    def delete(self, key: str) -> bool:
        k = _check_key(key)

        def delete(db: sqlite3.Connection, now: float) -> bool:
            if db.execute("DELETE FROM kv WHERE key = ?", (k,)).rowcount == 0:
                return False
            self._record(db, k, None, now)
            return True

        return self._write("delete", delete)

    def get_prefix(self, prefix: str) -> dict[str, bytes]:
        start = prefix.encode()
        end = _prefix_end(start)
        sql = f"SELECT key, value FROM kv WHERE key >= ? AND {_VISIBLE}"
        args: tuple[Any, ...] = (start, time.time())
        if end is not None:
            sql += " AND key < ?"
            args += (end,)
        return {bytes(k).decode(): bytes(v) for k, v in self._read("get-prefix", sql, args)}

    # -- leases ----------------------------------------------------------------------------
    def grant_lease(self, ttl: float) -> Lease:
        _check_ttl(ttl)

        def grant(db: sqlite3.Connection, now: float) -> int:
            cursor = db.execute("INSERT INTO leases (ttl, expires) VALUES (?, ?)",
                                (ttl, now + ttl))
            return int(cursor.lastrowid or 0)

        return StoreLease(self._write("grant-lease", grant), float(ttl), self)

    def _refresh_lease(self, lease_id: int) -> bool:
        return self._write("refresh-lease", lambda db, now: db.execute(
            "UPDATE leases SET expires = ? + ttl WHERE id = ?", (now, lease_id)).rowcount > 0)

    def _revoke_lease(self, lease_id: int) -> None:
        self._write("revoke-lease", lambda db, now: self._drop_lease(db, lease_id, now))

    # -- watches ---------------------------------------------------------------------------
    def watch_prefix(self, prefix: str, callback: WatchCallback) -> Watch:
        (revision,) = self._read("watch", "SELECT value FROM meta WHERE name = 'revision'", ())[0]
        watch = _EmbeddedWatch(self, prefix, callback, int(revision))
        with self._lock:
            self._watches = [w for w in self._watches if not w._cancelled.is_set()]
            self._watches.append(watch)
        return watch

    def _expire(self) -> None:
        """Delete the keys of expired leases now (so that watchers see the deletes)."""
        self._write("expire", lambda db, now: None)

    # -- election --------------------------------------------------------------------------
    def campaign(self, election: str, candidate: str, lease: Lease) -> bool:
        k, me = _check_key(election), candidate.encode()

        def campaign(db: sqlite3.Connection, now: float) -> bool:
            row = db.execute("SELECT value, lease FROM kv WHERE key = ?", (k,)).fetchone()
            if row is not None:
                return bytes(row[0]) == me and row[1] == lease.id
            lease_id = self._live_lease(db, lease)
            revision = self._record(db, k, me, now)
            db.execute("INSERT INTO kv (key, value, lease, revision) VALUES (?, ?, ?, ?)",
                       (k, me, lease_id, revision))
            return True

        return self._write("campaign", campaign)

    # -- lifetime --------------------------------------------------------------------------
    def close(self) -> None:
        if not self._stop_children():
            return
        with self._lock:
            self._closed = True
            self._db.close()


class _EmbeddedWatch:
    """Polls the change log of an :class:`EmbeddedStore` on a thread of its own."""

    def __init__(self, store: EmbeddedStore, prefix: str, callback: WatchCallback,
                 revision: int) -> None:
        self._store = store
        self._prefix = prefix
        self._callback = callback
        self._last = revision
        self._start = prefix.encode()
        self._end = _prefix_end(self._start)
        self._cancelled = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gemini-watch", daemon=True)
        self._thread.start()

    def cancel(self) -> None:
        self._cancelled.set()
        if self._thread is not threading.current_thread():
            self._thread.join()

    # Complexity above 10: the watch loop: poll, deliver, back off.
    def _run(self) -> None:  # noqa: C901
        db: sqlite3.Connection | None = None
        failing = False
        sql = "SELECT revision, key, value FROM events WHERE revision > ? AND key >= ?"
        if self._end is not None:
            sql += " AND key < ?"
        try:
            while not self._cancelled.wait(self._store.poll_interval):
                try:
                    if db is None:
                        db = self._store._connect()
                    if db.execute("SELECT 1 FROM leases WHERE expires <= ? LIMIT 1",
                                  (time.time(),)).fetchone() is not None:
                        self._store._expire()
                    args = (self._last, self._start) + ((self._end,) if self._end else ())
                    db.execute("BEGIN")  # one snapshot for both reads
                    try:
                        (trimmed,) = db.execute(
                            "SELECT value FROM meta WHERE name = 'trimmed'").fetchone()
                        rows = db.execute(sql + " ORDER BY revision", args).fetchall()
                    finally:
                        db.execute("COMMIT")
                except (sqlite3.Error, StoreError) as exc:
                    if not failing:
                        logger.warning("watch on %r cannot read %s, retrying: %s",
                                       self._prefix, self._store.path, exc)
                    failing = True
                    continue
                failing = False
                if trimmed > self._last:
                    logger.warning("watch on %r fell behind the change log; changes up to "
                                   "revision %d are lost", self._prefix, trimmed)
                for revision, key, value in rows:
                    if self._cancelled.is_set():
                        return
                    self._last = revision
                    try:
                        self._callback(bytes(key).decode(),
                                       None if value is None else bytes(value))
                    except Exception:
                        logger.exception("watch callback for prefix %r failed", self._prefix)
                self._last = max(self._last, trimmed)
        finally:
            if db is not None:
                db.close()

