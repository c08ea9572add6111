"""Where broker's Lua scripts live: ``broker/lua/``, one file per script or shared piece.

Each file opens with a ``--`` comment block that says what its KEYS and ARGV are and what it
returns. A file is named for the module whose script it is (``ledger_start.lua`` is
broker/ledger.py's START, ``caps_take.lua`` broker/caps.py's TAKE); a ``*_fn.lua`` file holds
functions a module's scripts share (the ledger's also cancel's and caps'), and ``now.lua``, the
one file of no module, is the prelude that sets ``now`` (Redis' own clock) for every script that
reads the time. A module puts its scripts together from these files once, at import: prelude
and functions first, then the script's own file.
"""

from __future__ import annotations

from pathlib import Path

from redis.commands.core import Script

from broker.states import lua

LUA_DIR = Path(__file__).with_name("lua")


def lua_script(text: str) -> Script:
    """A script as every module runs it: by EVALSHA on the client it is called with
    (``script(keys=..., args=..., client=r)``), loaded where the server does not have it yet."""
    return Script(None, text.encode("utf-8"))


def lua_file(name: str, **numbers: int) -> str:
    """The text of ``broker/lua/<name>.lua``: each ``$NAME`` of ``numbers`` made that number (a
    module's constant the script shares, ``lua_file("ledger_outage_fn", OUTAGES_KEPT=64)``), then
    each other ``$STATE`` the state's quoted string (broker/states.py ``lua``)."""
    text = (LUA_DIR / f"{name}.lua").read_text(encoding="utf-8")
    for constant, value in numbers.items():
        text = text.replace(f"${constant}", str(int(value)))
    return lua(text)


__all__ = ["LUA_DIR", "lua_file", "lua_script"]
