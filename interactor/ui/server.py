"""Serving the browser: a threaded Werkzeug server, in the foreground (``interactor ui``) or
in a thread of ``interactor run --ui``."""

from __future__ import annotations

import logging
import secrets
import threading

from broker.settings import Settings, SettingsError
from interactor.ui import DEFAULT_PORT
from interactor.ui.source import LiveState, Source
from interactor.webguard import allowed_hosts


def open_source(settings: Settings, *, redis_client=None) -> Source:
    """The store named by the settings, opened read-only, and Redis when a URL is set."""
    from consumer.storage import open_store

    store = open_store(settings.results_store, readonly=True)
    live = LiveState(settings, redis_client) if settings.redis_url else None
    return Source(store, store_shown=settings.results_store_shown, live=live)


class UIServer:
    def __init__(self, source: Source, host: str = "127.0.0.1", port: int = DEFAULT_PORT, *,
                 allow_actions: bool = False, token: str | None = None, allow_hosts: tuple[str, ...] = ()):
        from werkzeug.serving import make_server

        from interactor.ui.app import create_app

        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # not a line per poll
        self.source = source
        self.host = host
        self.token = (token or secrets.token_urlsafe(24)) if allow_actions else ""
        try:
            self.server = make_server(host, port, self._wsgi, threaded=True)
        except OSError as exc:
            raise SettingsError(f"cannot serve the results browser on {host}:{port}: {exc.strerror or exc}"
                                + (" (choose another --port)" if port else "")) from None
        self.port = self.server.server_port
        self.app = create_app(source, allow_actions=allow_actions, token=self.token,
                              allowed_hosts=allowed_hosts(host, self.port, allow_hosts))
        self._thread: threading.Thread | None = None

    def _wsgi(self, environ, start_response):
        return self.app(environ, start_response)

    @property
    def url(self) -> str:
        shown = {"0.0.0.0": "127.0.0.1", "::": "[::1]", "": "127.0.0.1"}.get(self.host, self.host)
        if ":" in shown and not shown.startswith("["):
            shown = f"[{shown}]"
        return f"http://{shown}:{self.port}/"

    @property
    def action_url(self) -> str:
        """The address to open with actions enabled: the token rides in the fragment, which
        browsers never send to a server (nor in a Referer)."""
        return f"{self.url}#token={self.token}" if self.token else self.url

    def start(self) -> "UIServer":
        self._thread = threading.Thread(target=self.server.serve_forever, name=f"ui:{self.port}", daemon=True)
        self._thread.start()
        return self

    def serve_until_signal(self) -> None:
        """The foreground: until SIGINT or SIGTERM."""
        from interactor.children import stop_event

        stop = stop_event()
        self.start()
        while not stop.wait(1.0):
            pass
        self.stop()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        try:
            self.source.store.close()
        except Exception:  # noqa: BLE001 - closing on the way out
            pass
