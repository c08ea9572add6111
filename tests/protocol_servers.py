"""What tests/test_env_protocols.py runs against: real OpenEnv and ORS servers (uvicorn in a
process of its own, on a free loopback port, made from the installed packages), OpenEnv's
``openenv init`` template generated into a folder, and a model stand-in that plays the
guessing games in text or through tool calls.

The policy reads the range ("between 1 and 50") and every "N is too low/high." of the
conversation (user and tool messages alike) and guesses the middle of what is left; offered a
``guess`` tool it calls it (``tool_calls``, no content), else it answers in text. Anything
else is answered "hello".
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import requests

from broker.embedded import free_port

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"


class Uvicorn:
    """``uvicorn MODULE:app`` with ``--app-dir``, in a process of its own; ``restart()`` stops
    it and starts it again on the same port (its sessions are lost, as a real restart loses them)."""

    def __init__(self, app: str, app_dir: Path, env: dict | None = None, log: Path | None = None):
        self.app, self.app_dir, self.env = app, app_dir, env or {}
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.proc: subprocess.Popen | None = None

    @staticmethod
    def tests_dir() -> Path:
        return TESTS

    def start(self, timeout: float = 240.0) -> "Uvicorn":
        # openenv and openreward take ~10 s to import on an idle machine, minutes on a loaded one
        import os

        env = {**os.environ, **self.env, "PYTHONPATH": f"{self.app_dir}:{ROOT}"}
        out = open(self.log, "ab") if self.log else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", self.app, "--app-dir", str(self.app_dir), "--host", "127.0.0.1",
             "--port", str(self.port), "--log-level", "warning", "--ws-ping-interval", "5"],
            env=env, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.app} exited with {self.proc.returncode}" +
                                   (f": {self.log.read_text()[-2000:]}" if self.log else ""))
            try:
                if requests.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{self.app} did not answer /health within {timeout}s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def restart(self) -> None:
        self.stop()
        self.start()


def openenv_template(folder: Path, name: str = "tmpl_env") -> Path:
    """``openenv init NAME`` in ``folder`` (offline), as a user starts an environment: the folder
    whose ``server.app:app`` serves it."""
    cli = Path(sys.executable).parent / "openenv"
    subprocess.run([str(cli), "init", name], cwd=folder, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, timeout=120)
    return folder / name


# --- the policy -----------------------------------------------------------------------------

def _text(content) -> str:
    if isinstance(content, list):
        return " ".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


def next_guess(messages: list) -> int | None:
    text = "\n".join(_text(m.get("content")) for m in messages if isinstance(m, dict))
    bounds = re.search(r"between (\d+) and (\d+)", text)
    if not bounds:
        return None
    lo, hi = int(bounds.group(1)), int(bounds.group(2))
    for n, word in re.findall(r"(-?\d+) is too (low|high)", text):
        if word == "low":
            lo = max(lo, int(n) + 1)
        else:
            hi = min(hi, int(n) - 1)
    return (lo + hi) // 2


class Policy(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, latency_s: float = 0.0):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.latency_s = latency_s
        self.requests: list[dict] = []
        self.lock = threading.Lock()
        self.url = f"http://127.0.0.1:{self.server_address[1]}/v1"
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def handle_error(self, request, client_address) -> None:
        pass  # a worker killed mid-request: nothing to say

    def answer(self, body: dict) -> dict:
        with self.lock:
            self.requests.append(body)
        if self.latency_s:
            time.sleep(self.latency_s)
        messages, tools = body.get("messages") or [], body.get("tools") or []
        guess = next_guess(messages)
        message: dict = {"role": "assistant", "content": "hello"}
        finish = "stop"
        if guess is not None and any((t.get("function") or {}).get("name") == "guess" for t in tools):
            message = {"role": "assistant", "content": None, "tool_calls": [
                {"id": f"call{len(messages)}", "type": "function",
                 "function": {"name": "guess", "arguments": json.dumps({"number": guess})}}]}
            finish = "tool_calls"
        elif guess is not None:
            message["content"] = f"My guess: {guess}"
        return {"id": "x", "object": "chat.completion", "model": "stand-in",
                "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                "usage": {"prompt_tokens": 10, "completion_tokens": 5}}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def _send(self, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802
        self._send({"object": "list", "data": [{"id": "stand-in", "object": "model"}]})

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        self._send(self.server.answer(body))
