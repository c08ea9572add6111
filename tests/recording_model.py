"""A vLLM-like model server for the tests, on loopback: it serves one model name and answers any
other with vLLM's 404 ("The model `x` does not exist."), records every chat request's body
(``bodies``), and answers with a ``reasoning_content`` beside the content, as vLLM's reasoning
parser and llama.cpp's ``--reasoning-format`` do. The content is ``<answer>N</answer>`` with N
the sum of the two numbers of the last user message (the arithmetic env's question), so that
episodes complete with reward 1."""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

REASONING = "First I add the two numbers, carefully."


class RecordingModel(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, name: str = "served-model"):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.name = name
        self.bodies: list[dict] = []
        self.lock = threading.Lock()
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


class _Handler(BaseHTTPRequestHandler):
    server: RecordingModel

    def log_message(self, *args) -> None:
        pass

    def _send(self, code: int, body: dict) -> None:
        raw = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self) -> None:
        if self.path.rstrip("/") == "/v1/models":
            return self._send(200, {"object": "list", "data": [{"id": self.server.name, "object": "model"}]})
        self._send(404, {"error": {"message": "not found"}})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        with self.server.lock:
            self.server.bodies.append(body)
        if body.get("model") != self.server.name:
            return self._send(404, {"object": "error", "type": "NotFoundError", "code": 404,
                                    "message": f"The model `{body.get('model')}` does not exist."})
        last = next((m.get("content") or "" for m in reversed(body.get("messages") or [])
                     if m.get("role") == "user"), "")
        numbers = [int(n) for n in re.findall(r"-?\d+", str(last))[:2]]
        content = f"<answer>{sum(numbers)}</answer>"
        self._send(200, {"id": "x", "object": "chat.completion", "model": self.server.name,
                         "choices": [{"index": 0, "finish_reason": "stop",
                                      "message": {"role": "assistant", "content": content,
                                                  "reasoning_content": REASONING}}],
                         "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}})
