"""The store's per-batch message JSON cache writes exactly what plain json would."""

from __future__ import annotations

import json

from consumer.store import _dumps, _messages_json


def test_messages_json_is_plain_json():
    sys_msg = {"role": "system", "content": "You are a helpful agent. ü \u2028 \"quoted\""}
    cases = [
        [],
        [sys_msg, {"role": "user", "content": "hi"}],
        [sys_msg, {"content": "order kept", "role": "user"}],  # key order matters in the text
        [{"role": "assistant", "content": None}],
        [{"role": "user", "content": [{"type": "text", "text": "parts"}]}],
        [{"role": "tool", "content": "x", "name": "calc"}],
        [sys_msg, "not a dict", 3, None],
        "not a list",
        {"a": 1},
    ]
    cache: dict = {}
    for msgs in cases:
        for _ in range(2):  # the second time from the cache
            text = _messages_json(msgs, cache)
            assert text == _dumps(msgs)
            assert json.loads(text) == msgs
