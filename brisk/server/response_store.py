"""Stored Responses (`store: true`, the default): embedded SQLite under the server's state folder.

One row per response: its final body (the Response object), the input items of its request and the items of
the conversation before them (`previous_response_id` continues from history + input + output), and the hash of
the API key that created it: a response is visible only with that key. Each write is one transaction in a
write-ahead log with `synchronous=FULL`, so a stored response survives a crash of the server or the machine.
Rows older than the TTL, and the oldest beyond the row limit, are deleted as new ones are written.

sqlite3 blocks, so every call runs on one worker thread (`asyncio.to_thread` would spread it over several).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_TTL_S = 30 * 24 * 3600
DEFAULT_MAX_RESPONSES = 100_000
SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    created REAL NOT NULL,
    body TEXT NOT NULL,
    input_items TEXT NOT NULL,
    history_items TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_created ON responses (created);
"""


def owner_of(authorization: str | None) -> str:
    """Who may see a response: a hash of the request's Authorization header (empty without keys)."""
    return hashlib.sha256((authorization or "").encode()).hexdigest()


@dataclass
class StoredResponse:
    body: dict[str, Any]
    input_items: list[dict[str, Any]]
    history_items: list[dict[str, Any]]

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
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(SCHEMA)

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    # ---- async API (the routes) ------------------------------------------------------------------
    async def put(self, owner: str, response: StoredResponse) -> None:
        await self._run(self._put, owner, response)

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
        row = (
            response.body["id"],
            owner,
            now,
            json.dumps(response.body),
            json.dumps(response.input_items),
            json.dumps(response.history_items),
        )
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            db.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?)", row)
            db.execute("DELETE FROM responses WHERE created < ?", (now - self.ttl_s,))
            db.execute(
                "DELETE FROM responses WHERE id IN (SELECT id FROM responses ORDER BY created DESC LIMIT -1 OFFSET ?)",
                (self.max_responses,),
            )
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise

    def _get(self, owner: str, response_id: str) -> StoredResponse | None:
        row = self._db.execute(
            "SELECT body, input_items, history_items FROM responses WHERE id = ? AND owner = ? AND created >= ?",
            (response_id, owner, time.time() - self.ttl_s),
        ).fetchone()
        if row is None:
            return None
        return StoredResponse(json.loads(row[0]), json.loads(row[1]), json.loads(row[2]))

    def _delete(self, owner: str, response_id: str) -> bool:
        cursor = self._db.execute("DELETE FROM responses WHERE id = ? AND owner = ?", (response_id, owner))
        return cursor.rowcount > 0
