"""A Python trainer's side of the rollout feed (interactor/feedserve.py): stdlib only, so a
trainer's environment needs nothing of ours but this file.

    feed = Feed("http://127.0.0.1:8700", trainer="grpo-0")
    for group in feed.take(8, timeout=60):
        ...
    feed.ack([g["group_id"] for g in groups]); feed.set_version(step)
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request


class FeedHTTPError(RuntimeError):
    def __init__(self, status: int, message: str):
        super().__init__(f"{status}: {message}")
        self.status = status


class Feed:
    def __init__(self, url: str, trainer: str = "trainer", token: str | None = None, timeout_s: float = 30.0):
        self.url = url.rstrip("/")
        self.trainer = trainer
        self.token = token if token is not None else os.environ.get("INTERACTOR_FEED_TOKEN", "")
        self.timeout_s = timeout_s

    def _call(self, method: str, path: str, body: dict | None = None, wait_s: float = 0.0) -> dict:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s + wait_s) as resp:
                return json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as exc:
            try:
                msg = json.loads(exc.read()).get("error", "")
            except ValueError:
                msg = exc.reason
            raise FeedHTTPError(exc.code, msg) from None

    def take(self, batch: int, timeout: float = 30.0) -> list[dict]:
        return self._call("POST", "/take", {"trainer": self.trainer, "batch": batch, "timeout": timeout},
                          wait_s=timeout)["groups"]

    def ack(self, ids: list[str]) -> dict:
        return self._call("POST", "/ack", {"trainer": self.trainer, "ids": list(ids)})

    def set_version(self, version: int) -> int:
        return self._call("POST", "/version", {"version": version})["version"]

    def version(self) -> int | None:
        return self._call("GET", "/version")["version"]

    def stats(self) -> dict:
        return self._call("GET", "/stats")

    def health(self) -> dict:
        return self._call("GET", "/health")
