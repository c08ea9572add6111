"""A Python trainer's side of the rollout feed (interactor/feedserve.py): stdlib only, so a
trainer's environment needs nothing of ours but this file.

    feed = Feed("http://127.0.0.1:8700", trainer="grpo-0")
    for group in feed.take(8, timeout=60):
        ...
    feed.ack([g["group_id"] for g in groups]); feed.set_version(step)

Redirects are not followed: urllib would send the ``Authorization`` header (the feed's token)
to whatever host a redirect names. A redirect is a :class:`FeedHTTPError` that names where it
pointed; give that URL to :class:`Feed` if it is the feed.
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


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """Every 3xx reaches the caller as an HTTPError: the token goes to the feed's URL only."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


class Feed:
    def __init__(self, url: str, trainer: str = "trainer", token: str | None = None, timeout_s: float = 30.0):
        self.url = url.rstrip("/")
        self.trainer = trainer
        self.token = token if token is not None else os.environ.get("INTERACTOR_FEED_TOKEN", "")
        self.timeout_s = timeout_s
        self._opener = urllib.request.build_opener(_NoRedirects)

    def _call(self, method: str, path: str, body: dict | None = None, wait_s: float = 0.0) -> dict:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        try:
            with self._opener.open(req, timeout=self.timeout_s + wait_s) as resp:
                return json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as exc:
            if 300 <= exc.code < 400:
                where = exc.headers.get("Location", "") if exc.headers is not None else ""
                raise FeedHTTPError(exc.code, f"the feed at {self.url} redirects {path} to {where[:200]!r}: not "
                                              "followed (its token goes to the URL it was given only)") from None
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
