"""Agents the agent-episode tests run (``agent: tests.agent_fakes:NAME``): each stands for one
way an agent behaves or misbehaves. A marker folder is passed in the task row (``marks``)."""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
import urllib.request

from openai import OpenAI


def _ask(base_url: str, api_key: str, model: str, text: str) -> str:
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": text}])
    return reply.choices[0].message.content or ""


def raises(task, base_url, api_key, model):
    _ask(base_url, api_key, model, "What is 1 + 1?")
    raise RuntimeError("the agent's own bug: no plan survives contact")


def no_reward(task, base_url, api_key, model):
    _ask(base_url, api_key, model, "What is 1 + 1?")
    return "done, I think"


def sleeps(task, base_url, api_key, model):
    _ask(base_url, api_key, model, "What is 1 + 1?")
    time.sleep(60)
    return 1.0


def stalls_first_time(task, base_url, api_key, model):
    """One call, then (on the first run only: a marker says it ran) waits to be killed."""
    marks = task["marks"]
    first = not os.path.exists(os.path.join(marks, "started"))
    _ask(base_url, api_key, model, f"What is {2 if first else 3} + 2?")
    if first:
        with open(os.path.join(marks, "started"), "w") as f:
            f.write(str(os.getpid()))
        time.sleep(120)
    _ask(base_url, api_key, model, "What is 10 + 10?")
    return {"reward": 0.5, "info": {"first": first}}


def _os_thread(fn) -> None:
    """``fn`` on a thread that outlives the agent's call (under the gevent pool a greenlet
    would end with the OS thread the agent ran on)."""
    try:
        from gevent import monkey
    except ImportError:
        monkey = None
    if monkey is not None and monkey.is_module_patched("threading"):
        monkey.get_original("_thread", "start_new_thread")(fn, ())
    else:
        threading.Thread(target=fn, daemon=True).start()


def calls_after_its_end(task, base_url, api_key, model):
    """Returns at once, leaving a thread behind that calls again once the episode has ended."""
    _ask(base_url, api_key, model, "What is 1 + 1?")
    out = os.path.join(task["marks"], "late-status")

    def later():
        time.sleep(0.5)
        request = urllib.request.Request(f"{base_url}/chat/completions", method="POST", data=json.dumps(
            {"model": model, "messages": [{"role": "user", "content": "What is 9 + 9?"}]}).encode(),
            headers={"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"})
        try:
            status = urllib.request.urlopen(request, timeout=10).status
        except urllib.error.HTTPError as exc:
            status = exc.code
        with open(out, "w") as f:
            f.write(str(status))

    _os_thread(later)
    return 1.0


def uses_anothers_key(task, base_url, api_key, model):
    """Calls its own session, then its group mate's (episode ``.1`` <-> ``.2``) with its own key."""
    _ask(base_url, api_key, model, "What is 1 + 1?")
    mine = base_url.rsplit("/sessions/", 1)[1].split("/", 1)[0]
    theirs = mine[:-1] + ("2" if mine.endswith("1") else "1")
    request = urllib.request.Request(f"{base_url.replace(mine, theirs)}/chat/completions", method="POST", data=json.dumps(
        {"model": model, "messages": [{"role": "user", "content": "What is 2 + 2?"}]}).encode(),
        headers={"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"})
    try:
        status = urllib.request.urlopen(request, timeout=10).status
    except urllib.error.HTTPError as exc:
        status = exc.code
    with open(os.path.join(task["marks"], f"other-{mine}"), "w") as f:
        f.write(str(status))
    return {"reward": 1.0, "info": {"other_status": status}}


def chats_twice(task, base_url, api_key, model):
    """Two turns of one conversation, each call's messages the last call's plus its answer and a
    new question: the calls' token ids extend one another (one segment)."""
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    for question in ("What is 4 + 4?", None):
        reply = client.chat.completions.create(model=model, messages=messages)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        if question:
            messages.append({"role": "user", "content": question})
    return 1.0


def says_where(task, base_url, api_key, model):
    """Writes the base URL it was given, then calls it once."""
    with open(os.path.join(task["marks"], "base-url-" + base_url.rsplit("/sessions/", 1)[1].split("/")[0]), "w") as f:
        f.write(base_url)
    _ask(base_url, api_key, model, "What is 5 + 5?")
    return 1.0
