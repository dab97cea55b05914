"""The stored-object database (app/store.py): bounds, filters, and durability under kill -9.

The durability test runs a real writer process that stores objects in a loop and prints each id once `put`
has returned (the moment a route acknowledges it); it is killed with SIGKILL mid-loop, and every id it
acknowledged must be in the reopened database, which must pass `PRAGMA integrity_check`.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

from app.store import Bounds, Store, Stored

REPO = Path(__file__).resolve().parents[2]
WRITER = """
import sys, time
from pathlib import Path
from app.store import Store, Stored
store = Store(Path(sys.argv[1]))
body = {"text": "x" * 20000}  # large enough that a write spans several pages: the kill lands mid-write often
i = 0
while True:
    store.put(Stored("response", f"resp_{i}", time.time(), "m", {}, body, {"n": i}))
    print(f"resp_{i}", flush=True)
    i += 1
"""


def _obj(i: int, created: float | None = None, model: str = "m", metadata: dict | None = None) -> Stored:
    return Stored("response", f"r{i}", time.time() if created is None else created, model, metadata or {},
                  {"id": f"r{i}"}, {"i": i})


def test_put_get_delete_and_reopen(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.db")
    store.put(_obj(1, metadata={"k": "v"}))
    store.close()
    again = Store(tmp_path / "s.db")
    found = again.get("response", "r1")
    assert found is not None and found.body == {"id": "r1"} and found.extra == {"i": 1} and found.metadata == {"k": "v"}
    assert again.get("chat.completion", "r1") is None  # kinds are apart
    assert again.delete("response", "r1") and not again.delete("response", "r1")
    assert again.get("response", "r1") is None


def test_oldest_dropped_first_past_max_count(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.db", Bounds(max_objects=3, max_age_s=-1))
    for i in range(5):
        store.put(_obj(i, created=1000.0 + i))
    assert [s.id for s in store.list("response", limit=10)] == ["r2", "r3", "r4"]


def test_expired_objects_dropped(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.db", Bounds(max_objects=0, max_age_s=60))
    store.put(_obj(0, created=time.time() - 3600))
    store.put(_obj(1))
    assert [s.id for s in store.list("response")] == ["r1"]


def test_list_filters_order_and_cursor(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.db", Bounds(max_age_s=-1))
    for i in range(4):
        store.put(_obj(i, created=1000.0 + i, model="a" if i % 2 else "b", metadata={"even": str(i % 2 == 0)}))
    assert [s.id for s in store.list("response", model="a")] == ["r1", "r3"]
    assert [s.id for s in store.list("response", metadata={"even": "True"})] == ["r0", "r2"]
    assert [s.id for s in store.list("response", order="desc", limit=2)] == ["r3", "r2"]
    assert [s.id for s in store.list("response", after="r1")] == ["r2", "r3"]


def test_update_metadata(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.db")
    store.put(_obj(1))
    assert store.update_metadata("response", "r1", {"a": "b"}, {"id": "r1", "metadata": {"a": "b"}})
    assert store.get("response", "r1").metadata == {"a": "b"}  # type: ignore[union-attr]
    assert not store.update_metadata("response", "nope", {}, {})


def test_kill_9_mid_write_loses_nothing_acknowledged(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for _ in range(2):  # two kills at different moments
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(db)], stdout=subprocess.PIPE, env=env, cwd=REPO)
        assert proc.stdout is not None
        acknowledged = []
        deadline = time.monotonic() + 120
        while len(acknowledged) < 25 and time.monotonic() < deadline:
            line = proc.stdout.readline().decode().strip()
            if not line:
                break
            acknowledged.append(line)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        acknowledged += [line for line in proc.stdout.read().decode().split() if line]
        assert len(acknowledged) >= 25, "the writer stored too little before the kill"
        with sqlite3.connect(db) as conn:
            assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        store = Store(db)
        missing = [rid for rid in acknowledged if store.get("response", rid) is None]
        store.close()
        assert missing == []
