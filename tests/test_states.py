"""One vocabulary of states (broker/states.py), and the code held to it.

The members are the strings on the wire and in the tables, so they must go through Redis,
msgpack, JSON and SQL unchanged and compare equal to what comes back; the ledger's Lua scripts
get theirs from :func:`broker.states.lua`. The scan below fails when a state is spelled as a
bare string in our source again: compared against, quoted inside SQL or Lua text, or used as the
key of a count of episodes by state.
"""

from __future__ import annotations

import ast
import json
import sqlite3
from pathlib import Path

import msgpack
import pytest

from broker import states
from broker.records import AttemptRecord, unpack
from broker.states import AttemptStatus, CloseAction, FeedGroupStatus, LedgerState, StartStatus, StoredStatus

pytestmark = pytest.mark.unit  # needs no server: make check runs it

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("broker", "producer", "workers", "consumer", "envs", "interactor", "bench", "examples")

# Words that only ever mean a state here: a count keyed by one of these is a count by state.
STATE_ONLY_WORDS = {LedgerState.QUEUED, LedgerState.RUNNING, LedgerState.RETRYING, LedgerState.DONE,
                    StoredStatus.COMPLETING, AttemptStatus.ABANDONED}
# Every state an episode, attempt, row, close or feed group can be in. (EndedBy and Phase are left
# out of the scan: their words - "length", "model", "prompt", "reset" - are also the env and
# model protocols' field names.)
STATE_WORDS = {str(m) for vocab in (LedgerState, AttemptStatus, StoredStatus, CloseAction, FeedGroupStatus)
               for m in vocab}
# START's answers too, in the Lua that gives them (Python's "ok" and "unknown" are too common a word
# to scan for).
LUA_WORDS = STATE_WORDS | {str(m) for m in StartStatus}


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def _strings(node: ast.AST) -> list[str]:
    """The string constants ``node`` is, or holds directly (a tuple, list or set of them)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return []


def bare_states(path: Path) -> list[str]:
    """Where ``path`` spells a state as a bare string, as ``file:line: what``."""
    tree = ast.parse(path.read_text(), str(path))
    docs = _docstrings(tree)
    rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            quoted = [w for w in STATE_WORDS if f"'{w}'" in node.value]
            if quoted:
                found.append(f"{rel}:{node.lineno}: {sorted(quoted)} quoted in SQL or Lua text")
        elif isinstance(node, ast.Compare):
            for side in (node.left, *node.comparators):
                hit = [w for w in _strings(side) if w in STATE_WORDS]
                if hit:
                    found.append(f"{rel}:{node.lineno}: compared with {hit}")
        elif isinstance(node, ast.Subscript):
            hit = [w for w in _strings(node.slice) if w in STATE_ONLY_WORDS]
            if hit:
                found.append(f"{rel}:{node.lineno}: indexed by {hit}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                and node.args:
            hit = [w for w in _strings(node.args[0]) if w in STATE_ONLY_WORDS]
            if hit:
                found.append(f"{rel}:{node.lineno}: .get({hit[0]!r})")
        elif isinstance(node, ast.Dict):
            hit = [w for k in node.keys if k is not None for w in _strings(k) if w in STATE_ONLY_WORDS]
            if hit:
                found.append(f"{rel}:{node.lineno}: dict keyed by {hit}")
    return found


def bare_states_in_lua(path: Path) -> list[str]:
    """Where a Lua file (broker/lua/) quotes a state instead of naming it ``$NAME``."""
    rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    found = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        quoted = [w for w in LUA_WORDS if f"'{w}'" in line]
        if quoted:
            found.append(f"{rel}:{n}: {sorted(quoted)} quoted in Lua text")
    return found


def test_no_state_is_spelled_as_a_bare_string_outside_the_states_module():
    found = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if path != ROOT / "broker" / "states.py":
                found += bare_states(path)
        for path in sorted((ROOT / pkg).rglob("*.lua")):
            found += bare_states_in_lua(path)
    assert not found, "use broker/states.py's members instead:\n" + "\n".join(found)


def test_the_scan_finds_each_way_a_state_was_spelled(tmp_path):
    # the scan itself must be able to fail: each shape it looks for, once
    src = tmp_path / "sample.py"
    src.write_text(
        "def f(rec, counts, r):\n"
        "    if rec.status == 'failed':\n"
        "        pass\n"
        "    if rec.status in ('completed', 'abandoned'):\n"
        "        pass\n"
        "    n = counts['running'] + counts.get('queued', 0)\n"
        "    r.execute(\"SELECT 1 FROM episodes WHERE status = 'completing'\")\n"
        "    return {'done': n}\n")
    text = "\n".join(bare_states(src))
    assert "compared with ['failed']" in text
    assert "compared with ['completed', 'abandoned']" in text
    assert "indexed by ['running']" in text and ".get('queued')" in text
    assert "['completing'] quoted in SQL or Lua text" in text
    assert "dict keyed by ['done']" in text
    lua_src = tmp_path / "sample.lua"
    lua_src.write_text("if st == 'running' then return 1 end\nif st == $DONE then return 2 end\n")
    assert bare_states_in_lua(lua_src) == ["sample.lua:1: ['running'] quoted in Lua text"]


def test_the_three_failed_states_are_one_string_and_three_names():
    assert LedgerState.FAILED == AttemptStatus.FAILED == StoredStatus.FAILED == "failed"
    assert {type(LedgerState.FAILED), type(AttemptStatus.FAILED), type(StoredStatus.FAILED)} == {
        LedgerState, AttemptStatus, StoredStatus}
    # a member is its string: same hash, so counts read back from Redis or SQL find it
    assert {"failed": 3}[LedgerState.FAILED] == 3 and {LedgerState.DONE: 1}["done"] == 1
    assert f"{StoredStatus.COMPLETING}" == "completing" and str(CloseAction.HAND_BACK) == "hand_back"


def test_members_travel_as_their_strings():
    rec = AttemptRecord(job_id="j", episode_id="e", attempt=1, status=AttemptStatus.ABANDONED, group_id="g",
                        group_size=1, env_name="countdown", llm_model="m")
    back = unpack(rec.pack())
    assert back.status == "abandoned" and type(back.status) is str and back.status == AttemptStatus.ABANDONED
    assert msgpack.unpackb(msgpack.packb({LedgerState.QUEUED: LedgerState.QUEUED})) == {"queued": "queued"}
    assert json.loads(json.dumps({LedgerState.RUNNING: StoredStatus.RUNNING})) == {"running": "running"}
    con = sqlite3.connect(":memory:")
    assert con.execute("SELECT ?", (StoredStatus.COMPLETED,)).fetchone() == ("completed",)


def test_lua_scripts_get_the_ledger_states_from_here():
    script = "if st == $DONE or st == $FAILED then return 1 end\nredis.call('HSET', k, e, $RUNNING)"
    assert states.lua(script) == ("if st == 'done' or st == 'failed' then return 1 end\n"
                                  "redis.call('HSET', k, e, 'running')")
    # Lua's own end-of-pattern anchor is left alone
    assert states.lua("string.match(s, '^(%d+):(.*)$')") == "string.match(s, '^(%d+):(.*)$')"
    with pytest.raises(ValueError, match=r"\$COMPLETED, which is neither a LedgerState"):
        states.lua("if st == $COMPLETED then end")
    # START's answers (StartStatus) as $START_NAME
    assert states.lua("return {$START_BUSY, holder}") == "return {'busy', holder}"
    with pytest.raises(ValueError, match=r"\$START_RUNNING, which is neither"):
        states.lua("return {$START_RUNNING}")


def test_each_vocabulary_is_what_the_tables_and_the_wire_say():
    # docs/protocol.md: these strings are in stored rows and on the wire; renaming one breaks readers
    # (values are only ever added: "cancelled" came with `interactor cancel`, broker/cancel.py)
    assert [str(s) for s in LedgerState] == ["queued", "running", "retrying", "done", "failed", "cancelled"]
    assert [str(s) for s in AttemptStatus] == ["completed", "retrying", "failed", "abandoned", "cancelled"]
    assert [str(s) for s in StoredStatus] == ["running", "completing", "completed", "retrying", "failed",
                                              "cancelled"]
    assert [str(s) for s in FeedGroupStatus] == ["ready", "failed"]
    assert states.LEDGER_FINAL | states.LEDGER_WAITING == set(LedgerState) - {LedgerState.RUNNING}
