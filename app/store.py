"""The API's stored objects: OpenAI stored responses (`/v1/responses`) and stored chat completions
(`/v1/chat/completions` with `store: true`), in one embedded SQLite database in the cache directory.

Durability: the database runs in WAL mode with `synchronous=FULL`; each object is written in one transaction,
committed before the route acknowledges it (returns the response, or sends `response.completed`), so a process
killed at any moment (kill -9) loses nothing a client was told about and leaves a database that passes
`PRAGMA integrity_check`. Bounded: each write also drops, oldest first, what exceeds the maximum count or age
(`--store-max-objects`, `--store-max-age`), in the same transaction.

One connection, used from worker threads under a lock (SQLite calls block; they stay off the event loop).
Several server processes may share the file: SQLite's own locking and a busy timeout serialise their writes.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from config import DEFAULT_CACHE_DIR

Kind = Literal["response", "chat.completion"]
KINDS: tuple[Kind, ...] = ("response", "chat.completion")
BUSY_TIMEOUT_MS = 30_000
SCHEMA = """
CREATE TABLE IF NOT EXISTS objects (
    kind TEXT NOT NULL,
    id TEXT NOT NULL,
    created_at REAL NOT NULL,
    model TEXT NOT NULL,
    metadata TEXT NOT NULL DEFAULT '{}',
    body TEXT NOT NULL,
    extra TEXT NOT NULL DEFAULT '{}',
    PRIMARY KEY (kind, id)
);
CREATE INDEX IF NOT EXISTS objects_by_age ON objects (kind, created_at);
"""


@dataclass(frozen=True, slots=True)
class Stored:
    """One stored object: its wire `body` (a dict) and `extra` (what the routes keep beside it)."""

    kind: Kind
    id: str
    created_at: float
    model: str
    metadata: dict[str, str]
    body: dict[str, Any]
    extra: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Bounds:
    max_objects: int = 10_000  # per kind; 0: unbounded
    max_age_s: float = 30 * 86400.0  # negative: forever


class Store:
    """The database. Methods are synchronous; the `a*` twins run them in a worker thread."""

    def __init__(self, path: Path, bounds: Bounds = Bounds()) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.bounds = bounds
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, timeout=BUSY_TIMEOUT_MS / 1000, check_same_thread=False,
                                   isolation_level=None)  # autocommit: transactions are explicit below
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")  # a commit is on disk before the route acknowledges it
        self._db.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        self._db.executescript(SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # ------------------------------------------------------------ writes: one transaction each

    def put(self, obj: Stored) -> None:
        """Insert or replace `obj` and drop what now exceeds the bounds, in one committed transaction."""
        row = (obj.kind, obj.id, obj.created_at, obj.model, json.dumps(obj.metadata), json.dumps(obj.body),
               json.dumps(obj.extra))
        with self._transaction() as db:
            db.execute("INSERT OR REPLACE INTO objects VALUES (?, ?, ?, ?, ?, ?, ?)", row)
            self._prune(db, obj.kind)

    def update_metadata(self, kind: Kind, id: str, metadata: dict[str, str], body: dict[str, Any]) -> bool:
        with self._transaction() as db:
            cur = db.execute("UPDATE objects SET metadata = ?, body = ? WHERE kind = ? AND id = ?",
                             (json.dumps(metadata), json.dumps(body), kind, id))
            return cur.rowcount > 0

    def delete(self, kind: Kind, id: str) -> bool:
        with self._transaction() as db:
            return db.execute("DELETE FROM objects WHERE kind = ? AND id = ?", (kind, id)).rowcount > 0

    def _prune(self, db: sqlite3.Connection, kind: Kind) -> None:
        if self.bounds.max_age_s >= 0:
            db.execute("DELETE FROM objects WHERE kind = ? AND created_at < ?",
                       (kind, time.time() - self.bounds.max_age_s))
        if self.bounds.max_objects > 0:
            db.execute(
                "DELETE FROM objects WHERE kind = ? AND id NOT IN (SELECT id FROM objects WHERE kind = ? "
                "ORDER BY created_at DESC, rowid DESC LIMIT ?)", (kind, kind, self.bounds.max_objects),
            )

    def _transaction(self) -> _Transaction:
        return _Transaction(self._db, self._lock)

    # ------------------------------------------------------------ reads

    def get(self, kind: Kind, id: str) -> Stored | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM objects WHERE kind = ? AND id = ?", (kind, id)).fetchone()
        return _stored(row) if row is not None else None

    def list(self, kind: Kind, *, model: str | None = None, metadata: dict[str, str] | None = None,
             after: str | None = None, limit: int = 20, order: Literal["asc", "desc"] = "asc") -> list[Stored]:
        """Objects of `kind` by creation time, filtered by model and metadata (every pair must match),
        starting after the object `after` (a cursor; unknown: from the start). At most `limit`."""
        sql, args = "SELECT * FROM objects WHERE kind = ?", [kind]
        if model is not None:
            sql, args = sql + " AND model = ?", [*args, model]
        direction = "DESC" if order == "desc" else "ASC"
        with self._lock:
            rows = self._db.execute(f"{sql} ORDER BY created_at {direction}, rowid {direction}", args).fetchall()
        wanted = (metadata or {}).items()  # filtered here: any key is fine, and the store is bounded
        found = [s for s in map(_stored, rows) if all(s.metadata.get(k) == v for k, v in wanted)]
        if after is not None:
            ids = [s.id for s in found]
            found = found[ids.index(after) + 1:] if after in ids else found
        return found[:limit]

    # ------------------------------------------------------------ async twins (off the event loop)

    async def aput(self, obj: Stored) -> None:
        await asyncio.to_thread(self.put, obj)

    async def aget(self, kind: Kind, id: str) -> Stored | None:
        return await asyncio.to_thread(self.get, kind, id)

    async def adelete(self, kind: Kind, id: str) -> bool:
        return await asyncio.to_thread(self.delete, kind, id)


class _Transaction:
    """`BEGIN IMMEDIATE` ... `COMMIT` (or `ROLLBACK` on error) under the store's lock."""

    def __init__(self, db: sqlite3.Connection, lock: threading.Lock) -> None:
        self._db, self._lock = db, lock

    def __enter__(self) -> sqlite3.Connection:
        self._lock.acquire()
        try:
            self._db.execute("BEGIN IMMEDIATE")
        except BaseException:
            self._lock.release()
            raise
        return self._db

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            self._db.execute("ROLLBACK" if exc_type is not None else "COMMIT")
        finally:
            self._lock.release()


def _stored(row: tuple) -> Stored:
    kind, id, created_at, model, metadata, body, extra = row
    return Stored(kind, id, created_at, model, json.loads(metadata), json.loads(body), json.loads(extra))


def store_path(cache_dir: Path | str) -> Path:
    return Path(cache_dir).expanduser() / "api-store.sqlite3"


def open_store(settings: Any) -> Store:
    """The store the settings name (`--store-path`, else `<cache_dir>/api-store.sqlite3`), bounded by them."""
    default = Bounds()
    path = getattr(settings, "store_path", None) or store_path(getattr(settings, "cache_dir", DEFAULT_CACHE_DIR))
    bounds = Bounds(getattr(settings, "store_max_objects", default.max_objects),
                    getattr(settings, "store_max_age_s", default.max_age_s))
    return Store(Path(path).expanduser(), bounds)


def app_store(app: Any) -> Store:
    """The app's store, opened on first use (so a server that never stores anything never creates the file)."""
    store = getattr(app.state, "store", None)
    if store is None:
        store = app.state.store = open_store(getattr(app.state, "settings", None))
    return store
