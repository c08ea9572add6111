"""Which requests our local HTTP servers answer, whatever a web page in the operator's browser
makes it send: the Host header names this server (no DNS rebinding), and nothing says the
request comes from another site (Origin, Sec-Fetch-Site). The results browser
(interactor/ui/) and the rollout feed (interactor/feedserve.py) share these checks.

Why both matter on loopback: any page the operator opens can send "simple" requests to
127.0.0.1 (no preflight), and a page whose own DNS name it points at 127.0.0.1 can read the
answers too. The page's own name is in Host then, and a browser's cross-site request says where
it comes from in Origin and Sec-Fetch-Site.
"""

from __future__ import annotations

import ipaddress
from typing import Callable

# Sec-Fetch-Site values of a request that no other site made: our own page, or the user typing
# the address (browsers send no such header to other clients' requests: curl, a trainer).
OWN_FETCH_SITES = ("same-origin", "none")


def is_loopback(host: str) -> bool:
    """``host`` (a name or an address, IPv6 with or without brackets) is this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def allowed_hosts(host: str, port: int, extra: tuple[str, ...] | list[str] = ()) -> set[str] | None:
    """Host header values a request may carry: the address we listen on and, on loopback, the
    loopback names, plus ``extra`` (``--allow-host``, as ``name:port`` or ``name``). A page on
    another site that points its own DNS name at 127.0.0.1 (DNS rebinding) sends its own name
    and is refused. Listening on every interface (0.0.0.0, ::) without ``extra`` accepts any
    name: the people reaching it use names we cannot know."""
    extra_set = {h.strip().lower() for h in extra if h.strip()}
    if host in ("", "0.0.0.0", "::"):
        return extra_set or None
    names = {host}
    if is_loopback(host):
        names |= {"127.0.0.1", "localhost", "::1"}
    out = set()
    for name in names:
        shown = f"[{name}]" if ":" in name and not name.startswith("[") else name
        out.add(f"{shown}:{port}".lower())
        if port == 80:
            out.add(shown.lower())
    return out | extra_set


def cross_site_refusal(header: Callable[[str], str | None], own_origin: str) -> str:
    """Why a request from another site is refused ("" when nothing says it is one).
    ``header(name)``: the request's header or None; ``own_origin``: ``scheme://host[:port]`` as
    the request named us (its Host). A request with no Origin and no Sec-Fetch-Site is not a
    browser's cross-site one (browsers send Origin with every cross-origin POST)."""
    site = header("Sec-Fetch-Site")
    if site is not None and site not in OWN_FETCH_SITES:
        return "cross-site request refused"
    origin = header("Origin")
    if origin is not None and origin.lower() != own_origin.lower():
        return "cross-origin request refused"
    return ""
