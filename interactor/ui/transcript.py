"""An episode's steps as one chat: what the env said, what the model answered, step by step.

Each ``session_steps`` row holds the prompt the model was sent at that step (the env's
conversation, trimmed to the last messages by ``message_cut``) and the answer. Printing every
prompt in full repeats the conversation once per step; instead each step shows only the
messages its prompt adds to what the reader has already seen (the previous prompt and its
answer), and keeps the full prompt, exactly as sent, one click away.

Everything here is data for templates, which escape it: message text is untrusted (model
answers, env observations), and images are only ever ``data:image/...`` URLs shown in an
``<img>``; a remote image URL is shown as text, never fetched.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import orjson

# Raster formats and SVG: an <img> never runs an SVG's scripts, and the page's CSP allows
# images from data: URLs only (besides its own files).
_DATA_IMAGE = re.compile(r"^data:image/(png|jpeg|jpg|gif|webp|bmp|avif|svg\+xml);base64,[A-Za-z0-9+/=\s]+$")


@dataclass
class Part:
    kind: str  # text | image (a data: URL) | image_link (any other URL: shown, not loaded) | json
    value: str


@dataclass
class Message:
    role: str
    parts: list[Part]
    name: str = ""

    @property
    def text(self) -> str:
        """The message as plain text (images as placeholders): for tests and search."""
        return "\n".join(p.value if p.kind in ("text", "json") else f"[image {p.kind}]" for p in self.parts)


@dataclass
class StepView:
    row: dict  # the session_steps row (messages decoded)
    shown: list[Message]  # the prompt's messages not seen before, in order
    prompt: list[Message]  # the whole prompt as sent
    answer: Message
    repeated: int = 0  # messages of the prompt already shown above
    restarted: bool = False  # the prompt does not continue the conversation shown so far
    flags: list[str] = field(default_factory=list)


def parts_of(content: Any) -> list[Part]:
    """A message's content as displayable parts: a string, a list of OpenAI content parts
    (text, image_url), or anything else as JSON."""
    if content is None:
        return []
    if isinstance(content, str):
        return [Part("text", content)]
    if isinstance(content, list):
        out = []
        for item in content:
            if isinstance(item, str):
                out.append(Part("text", item))
            elif isinstance(item, dict) and item.get("type") in ("text", "input_text", "output_text"):
                out.append(Part("text", str(item.get("text") or "")))
            elif isinstance(item, dict) and item.get("type") in ("image_url", "input_image", "image"):
                url = item.get("image_url", item.get("url", item.get("image")))
                if isinstance(url, dict):
                    url = url.get("url")
                out.append(image_part(url))
            else:
                out.append(Part("json", _json(item)))
        return out
    return [Part("json", _json(content))]


def image_part(url: Any) -> Part:
    if isinstance(url, str) and _DATA_IMAGE.match(url):
        return Part("image", url)
    return Part("image_link", str(url)[:500])


def message_of(raw: Any) -> Message:
    if not isinstance(raw, dict):
        return Message("unknown", [Part("json", _json(raw))])
    parts = parts_of(raw.get("content"))
    extra = {k: v for k, v in raw.items() if k not in ("role", "content", "name")}
    if extra:  # tool calls, function results...: shown as they are
        parts.append(Part("json", _json(extra)))
    return Message(str(raw.get("role") or "unknown"), parts, str(raw.get("name") or ""))


def step_flags(row: dict) -> list[str]:
    flags = []
    for key, label in (("is_terminal", "terminal"), ("is_truncated", "truncated"),
                       ("is_session_completed", "last step"), ("is_trainable", "trainable")):
        if row.get(key):
            flags.append(label)
    return flags


def chat(steps: list[dict]) -> list[StepView]:
    """The steps of one trajectory (``ResultStore.episode_trajectory``) as chat turns."""
    out: list[StepView] = []
    seen_system: Any = None
    context: list[Any] = []  # the conversation so far: previous prompt's body and its answer
    for row in steps:
        raw = row.get("messages")
        raw = raw if isinstance(raw, list) else ([] if raw is None else [raw])
        answer_raw = {"role": "assistant", "content": row.get("response") or ""}
        system, body = (raw[0], raw[1:]) if raw and isinstance(raw[0], dict) and raw[0].get("role") == "system" \
            else (None, raw)
        shown_raw: list[Any] = []
        repeated = 0
        if system is not None:
            if system == seen_system:
                repeated += 1
            else:
                shown_raw.append(system)
                seen_system = system
        overlap = _overlap(context, body)
        restarted = bool(context) and overlap == 0 and bool(body)
        shown_raw += body[overlap:]
        repeated += overlap
        out.append(StepView(row=row, shown=[message_of(m) for m in shown_raw], prompt=[message_of(m) for m in raw],
                            answer=message_of(answer_raw), repeated=repeated, restarted=restarted,
                            flags=step_flags(row)))
        context = list(body) + [answer_raw]
    return out


def _overlap(context: list[Any], body: list[Any]) -> int:
    """The longest run of messages that ends ``context`` and starts ``body``: how much of this
    prompt the reader has already seen (a trimmed prompt keeps the tail of the conversation).

    Knuth-Morris-Pratt over the messages, linear in their number: trying every length was
    quadratic, and an episode of long prompts that never overlap (a restarted conversation on
    every step) made one page cost seconds."""
    n = min(len(context), len(body))
    if not n:
        return 0
    keys = {}
    def key(m: Any) -> int:  # messages are dicts: compare them through a stable id per value
        k = orjson.dumps(m, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS, default=str)
        return keys.setdefault(k, len(keys))
    pattern = [key(m) for m in body[:n]]
    text = [key(m) for m in context[-n:]]
    fail = [0] * len(pattern)  # fail[i]: the longest proper border of pattern[:i + 1]
    k = 0
    for i in range(1, len(pattern)):
        while k and pattern[i] != pattern[k]:
            k = fail[k - 1]
        if pattern[i] == pattern[k]:
            k += 1
        fail[i] = k
    k = 0  # how much of pattern matches the text read so far
    for t in text:
        while k and (k == len(pattern) or t != pattern[k]):
            k = fail[k - 1]
        if t == pattern[k]:
            k += 1
    return k


def conversation(steps: list[dict]) -> list[Message]:
    """The whole conversation as one list (each step's new messages, then its answer)."""
    out: list[Message] = []
    for view in chat(steps):
        out += view.shown
        out.append(view.answer)
    return out


def _json(obj: Any) -> str:
    try:
        return orjson.dumps(obj, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS, default=str).decode()
    except TypeError:
        return repr(obj)
