"""Stored Responses (`store: true`, the default): embedded SQLite under the server's state folder.

One row per response: its body (the Response object), the input items of its request and the items of the
conversation before them (`previous_response_id` continues from history + input + output), and the hash of the
API key that created it: a response is visible only with that key. Each write is one transaction in a
write-ahead log with `synchronous=FULL`, so a stored response survives a crash of the server or the machine.
Rows older than the TTL, and the oldest beyond the row limit, are deleted as new ones are written.

A response whose id is handed out before it finishes (background, streamed) is stored when it starts, `queued`
or `in_progress`, with the process running it (pid and start time: a pid alone may be reused), and rewritten as
it runs. Whoever reads such a row while that process is gone (it crashed, the server restarted) finds it
`failed` with the reason, and writes it so: every process of a server reads the same file, so any of them may
be the one to find out. An id handed out never reads as a 404.

sqlite3 blocks, so every call runs on one worker thread (`asyncio.to_thread` would spread it over several).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from brisk.server.auth import bearer_token

DEFAULT_TTL_S = 30 * 24 * 3600
DEFAULT_MAX_RESPONSES = 100_000
BUSY_TIMEOUT_S = 10.0  # how long a write waits for another process of the server holding the file's lock
WAL_RETRY_S = 0.01  # the pause between tries to switch a file others have open to WAL
SCHEMA = (
    """CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    created REAL NOT NULL,
    body TEXT NOT NULL,
    input_items TEXT NOT NULL,
    history_items TEXT NOT NULL
)""",
    "CREATE INDEX IF NOT EXISTS responses_created ON responses (created)",
)
# Columns added since the first schema (a state folder written by an older brisk gets them at open).
LATER_COLUMNS = {
    "runner": "TEXT",  # the process running a queued / in_progress response ("pid:start ticks"); NULL once it ended
    "last_event": "INTEGER NOT NULL DEFAULT -1",  # the sequence number of its last stream event, when stored
}
RUNNING = ("queued", "in_progress")
INTERRUPTED_MESSAGE = "The server stopped while this response was running; it did not finish."


INSERT = (
    "INSERT INTO responses (id, owner, created, body, input_items, history_items, runner, last_event)"
    " VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
)


def _row(owner: str, response: StoredResponse, now: float) -> tuple[Any, ...]:
    """A response's row, for INSERT."""
    body, running = response.body, response.running
    items, history = json.dumps(response.input_items), json.dumps(response.history_items)
    runner = response.runner if running else None
    return (body["id"], owner, now, json.dumps(body), items, history, runner, response.last_event)


def owner_of(authorization: str | None) -> str:
    """Who may see a response: a hash of the request's Authorization header (empty without keys), its scheme
    spelled as "Bearer" whatever the case the client sent (the header's canonical form)."""
    token = bearer_token(authorization) if authorization else None
    canonical = f"Bearer {token}" if token is not None else authorization or ""
    return hashlib.sha256(canonical.encode()).hexdigest()


def this_process() -> str:
    """This process as a response's runner: its pid and start time (a later process may get the same pid)."""
    return f"{os.getpid()}:{_start_ticks(os.getpid())}"


def _start_ticks(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]  # field 22, starttime
    except (OSError, IndexError):
        return "?"


def runner_alive(runner: str) -> bool:
    pid, _, start = runner.partition(":")
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError):
        return True  # someone's process: not knowably dead
    return start == "?" or _start_ticks(int(pid)) == start


@dataclass
class StoredResponse:
    body: dict[str, Any]
    input_items: list[dict[str, Any]]
    history_items: list[dict[str, Any]]
    runner: str | None = None  # the process running it, while it is queued or in progress
    last_event: int = -1  # the sequence number of its last stream event when it was written

    @property
    def running(self) -> bool:
        return self.body.get("status") in RUNNING

    def conversation(self) -> list[dict[str, Any]]:
        """The items a follow-up response continues from: history, this input, this output."""
        return self.history_items + self.input_items + list(self.body.get("output") or [])


class ResponseStore:
    def __init__(
        self, state_dir: str | Path, ttl_s: float = DEFAULT_TTL_S, max_responses: int = DEFAULT_MAX_RESPONSES
    ) -> None:
        self.path = Path(state_dir) / "responses.sqlite3"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.ttl_s, self.max_responses = ttl_s, max_responses
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="brisk-response-store")
        # Other processes of the server open and write the same file: wait for their locks (set before anything
        # else), and create or upgrade the schema in one write transaction, so two never both add a column.
        self._db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, check_same_thread=False, isolation_level=None)
        self._db.execute(f"PRAGMA busy_timeout={int(BUSY_TIMEOUT_S * 1000)}")
        self._use_wal()
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("BEGIN IMMEDIATE")
        try:
            for statement in SCHEMA:
                self._db.execute(statement)
            present = {row[1] for row in self._db.execute("PRAGMA table_info(responses)")}
            for column, kind in LATER_COLUMNS.items():
                if column not in present:
                    self._db.execute(f"ALTER TABLE responses ADD COLUMN {column} {kind}")
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def _use_wal(self) -> None:
        """The file in WAL mode (kept in the file once set). Switching needs the file to itself and SQLite does not
        wait for that (busy_timeout does not apply): processes opening it at once retry until BUSY_TIMEOUT_S."""
        deadline = time.monotonic() + BUSY_TIMEOUT_S
        while True:
            try:
                if self._db.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                    self._db.execute("PRAGMA journal_mode=WAL")
                return
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(WAL_RETRY_S)

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    # ---- async API (the routes) ------------------------------------------------------------------
    async def put(self, owner: str, response: StoredResponse) -> None:
        await self._run(self._put, owner, response)

    async def claim(self, owner: str, response: StoredResponse) -> bool:
        """Store a response under an id its request chose (vLLM's request_id): False, writing nothing, where a live
        row has that id already (a client may never take over another's response)."""
        return await self._run(self._claim, owner, response)

    async def get(self, owner: str, response_id: str) -> StoredResponse | None:
        return await self._run(self._get, owner, response_id)

    async def delete(self, owner: str, response_id: str) -> bool:
        return await self._run(self._delete, owner, response_id)

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        self._db.close()

    # ---- on the store's thread -------------------------------------------------------------------
    def _put(self, owner: str, response: StoredResponse) -> None:
        now = time.time()
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            # A row keeps the time it was first written: the TTL and the row limit count from a response's start.
            db.execute(
                INSERT + " ON CONFLICT (id) DO UPDATE SET owner = excluded.owner, body = excluded.body, input_items ="
                " excluded.input_items, history_items = excluded.history_items, runner = excluded.runner, last_event"
                " = excluded.last_event",
                _row(owner, response, now),
            )
            db.execute("DELETE FROM responses WHERE created < ?", (now - self.ttl_s,))
            db.execute(
                "DELETE FROM responses WHERE id IN (SELECT id FROM responses ORDER BY created DESC LIMIT -1 OFFSET ?)",
                (self.max_responses,),
            )
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise

    def _claim(self, owner: str, response: StoredResponse) -> bool:
        now = time.time()
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            db.execute("DELETE FROM responses WHERE created < ?", (now - self.ttl_s,))  # an expired id is free
            cursor = db.execute(INSERT + " ON CONFLICT (id) DO NOTHING", _row(owner, response, now))
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        return cursor.rowcount == 1

    def _get(self, owner: str, response_id: str) -> StoredResponse | None:
        row = self._db.execute(
            "SELECT body, input_items, history_items, runner, last_event FROM responses"
            " WHERE id = ? AND owner = ? AND created >= ?",
            (response_id, owner, time.time() - self.ttl_s),
        ).fetchone()
        if row is None:
            return None
        stored = StoredResponse(json.loads(row[0]), json.loads(row[1]), json.loads(row[2]), row[3], row[4])
        if stored.running and not (stored.runner and runner_alive(stored.runner)):
            self._mark_interrupted(owner, stored)
        return stored

    def _mark_interrupted(self, owner: str, stored: StoredResponse) -> None:
        """A running response whose process is gone: failed, with the reason (written once, by whoever finds it)."""
        runner, stored.runner = stored.runner, None
        stored.body["status"] = "failed"
        stored.body["error"] = {
            "message": INTERRUPTED_MESSAGE,
            "type": "server_error",
            "param": None,
            "code": "interrupted",
        }
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            db.execute(
                "UPDATE responses SET body = ?, runner = NULL WHERE id = ? AND owner = ? AND runner IS ?",
                (json.dumps(stored.body), stored.body["id"], owner, runner),
            )
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise

    def _delete(self, owner: str, response_id: str) -> bool:
        cursor = self._db.execute("DELETE FROM responses WHERE id = ? AND owner = ?", (response_id, owner))
        return cursor.rowcount > 0
