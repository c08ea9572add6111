"""The results browser's guards: the Host check against DNS rebinding, the security headers of
every response (a Content-Security-Policy that runs nothing but this server's own files), and
the guard on state-changing actions (on by the command line, same-origin, with the token)."""

from __future__ import annotations

import hmac

from flask import Flask, abort, request

from interactor.webguard import cross_site_refusal

CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "form-action 'self'; base-uri 'none'; frame-ancestors 'none'")


def register(app: Flask, allowed_hosts: set[str] | None) -> None:
    """The Host check before every request and the headers after it."""

    @app.before_request
    def check_host():
        if allowed_hosts is not None and request.host.lower() not in allowed_hosts:
            abort(421, "this server answers only to its own address (DNS rebinding protection)")

    @app.after_request
    def headers(resp):
        resp.headers["Content-Security-Policy"] = CSP
        resp.headers["X-Content-Type-Options"] = "nosniff"
        # Not no-referrer: under it browsers send "Origin: null" with our own form posts, which
        # the action guard must refuse; same-origin sends nothing to other sites either way.
        resp.headers["Referrer-Policy"] = "same-origin"
        resp.headers["X-Frame-Options"] = "DENY"
        resp.headers.setdefault("Cache-Control", "no-store")
        return resp


def check_action(app: Flask) -> None:
    """A state-changing request: allowed by the command line, same-origin, with the token."""
    if not app.config["allow_actions"]:
        abort(403, "actions are off: start `interactor ui --allow-actions` (it prints the token they need)")
    refused = cross_site_refusal(request.headers.get, request.host_url.rstrip("/"))
    if refused:
        abort(403, refused)
    given = request.form.get("token", "")
    if not hmac.compare_digest(given.encode(), app.config["token"].encode()):
        abort(403, "wrong or missing action token (the one `interactor ui --allow-actions` printed)")


def browser_who() -> str:
    """Who the audit log says made a change from the browser: its client's address, bounded to
    one short line (the address is the peer's, not a header a client could write)."""
    addr = " ".join(str(request.remote_addr or "?").split())[:64]
    return f"browser @ {addr}"
