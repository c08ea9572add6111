"""Every command and snippet in README.md and docs/ works as written: the task files parse (and
their limits are accepted), every `interactor ...` command line and every `--flag` named beside
a command exists, every `make` target exists, the Python snippets compile, and the README's own
examples run: its task file and `interactor run` command against the stand-in servers, its
trainer loop against a real feed server."""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
import threading

import pytest
import yaml

from tests.conftest import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
INLINE = re.compile(r"`((?:\.venv/bin/)?interactor [^`]+)`")


def blocks(lang: str | None = None) -> list[tuple[str, str, str]]:
    """(file, language, text) of every fenced block, of one language if given."""
    out = []
    for path in DOCS:
        for m in FENCE.finditer(path.read_text()):
            if lang is None or m.group(1) == lang:
                out.append((path.name, m.group(1), m.group(2)))
    return out


def parser() -> argparse.ArgumentParser:
    from bench.bench_command import register as bench_commands
    from interactor.cli import build_parser

    return build_parser((bench_commands,))


def subparser(p: argparse.ArgumentParser, words: list[str]) -> tuple[argparse.ArgumentParser, list[str]]:
    """The deepest command parser the words name, and the words after it."""
    while words:
        subs = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or words[0] not in subs[0].choices:
            break
        p, words = subs[0].choices[words[0]], words[1:]
    return p, words


def command_lines() -> list[tuple[str, list[str]]]:
    """Every shell line of a fenced block that runs interactor, as its arguments."""
    out = []
    for name, lang, text in blocks():
        if lang not in ("", "sh", "bash"):
            continue
        for line in text.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            if not re.match(r"^([A-Z_]+=\S* +)*(\.venv/bin/)?interactor ", line):
                continue  # output, a diagram, another program
            words = shlex.split(line)
            while words and re.match(r"^[A-Z_]+=", words[0]):  # VAR=value before the command
                words = words[1:]
            if words and words[0] in ("interactor", ".venv/bin/interactor"):
                out.append((name, words[1:]))
    return out


@pytest.mark.parametrize("where,argv", command_lines(), ids=lambda v: " ".join(v) if isinstance(v, list) else v)
@pytest.mark.unit
def test_every_interactor_command_line_parses(where, argv):
    p = parser()
    if argv and argv[0] == "serve-model":  # the stand-in's own parser takes the rest
        from examples.model_standin import build_parser as standin

        p, argv = standin(), argv[1:]
    try:
        p.parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"{where}: `interactor {' '.join(argv)}` does not parse (exit {exc.code})")


def inline_commands() -> list[tuple[str, str]]:
    out = []
    for path in DOCS:
        for m in INLINE.finditer(path.read_text()):
            out.append((path.name, m.group(1)))
    return out


@pytest.mark.parametrize("where,snippet", inline_commands(), ids=lambda v: v)
def test_every_flag_named_beside_a_command_exists(where, snippet):
    """`interactor results JOB --groups` in prose: the command exists and offers each flag."""
    words = snippet.replace("|", " ").replace("[", " ").replace("]", " ").split()
    words = words[1:]
    p, rest = subparser(parser(), words)
    if p.prog.endswith("serve-model"):
        from examples.model_standin import build_parser as standin

        p = standin()
    flags = {o for a in p._actions for o in a.option_strings}
    for w in rest:
        flag = w.split("=", 1)[0]
        if flag.startswith("--") and flag != "--help":
            assert flag in flags, f"{where}: `{snippet}`: {p.prog} has no {flag}"


@pytest.mark.unit
def test_every_make_target_named_exists():
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([\w-]+):", makefile, re.M))
    named = set()
    for path in DOCS:
        named |= set(re.findall(r"`make ([\w-]+)`", path.read_text()))
    for _, lang, text in blocks():
        named |= set(re.findall(r"^make ([\w-]+)", text, re.M))
    assert named and named <= targets, f"no such make target: {sorted(named - targets)}"


@pytest.mark.unit
def test_every_python_snippet_compiles():
    for name, _, text in blocks("python"):
        compile(text, name, "exec")


def task_file_blocks() -> list[tuple[str, str]]:
    return [(name, text) for name, _, text in blocks("yaml") if "environments:" in text or "limits:" in text]


@pytest.mark.parametrize("where,text", task_file_blocks(), ids=lambda v: v if len(v) < 40 else v[:40])
def test_every_task_file_shown_is_accepted(where, text, tmp_path, settings):
    """Each task file (or top of one) as the page shows it, its datasets made, planned as
    `interactor submit` plans one: nothing refused."""
    from producer.enqueue import plan

    doc = yaml.safe_load(text)
    if "environments" not in doc:  # a file's top-level limits: entries that use them
        servers = list((doc.get("limits") or {}).get("env_servers") or {}) or ["http://envs:8080"]
        names = list((doc.get("limits") or {}).get("env_names") or {}) or ["guess_number"]
        doc["environments"] = [{"env_name": n, "base_url": s, "env_num": 1}
                               for s in servers for n in names]
    for entry in doc["environments"]:
        ds = entry.get("dataset")
        if isinstance(ds, str):
            (tmp_path / ds).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / ds).write_text(json.dumps({"question": "What is 1 + 4?", "answer": 5}) + "\n")
    path = tmp_path / "tasks.yaml"
    path.write_text(yaml.safe_dump(doc))
    # an excerpt without base_url runs with --env-base-url
    planned = plan(settings.replace(env_base_url="http://envs:8080"), [str(path)])
    assert planned.episodes


# --- the README's own examples, run ----------------------------------------------------------------
def readme_block(lang: str, containing: str) -> str:
    found = [t for n, lang_, t in blocks(lang) if n == "README.md" and containing in t]
    assert len(found) == 1, (lang, containing, len(found))
    return found[0]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.integration
def test_the_readmes_task_file_and_run_command_run_to_their_end(tmp_path, model_server):
    """As a newcomer runs them: the env server the README starts (`interactor serve-env`), its
    task file with its own base_url and dataset path, in a checkout, and its `run` line; only
    the model server is the stand-in's (the README's is the reader's own), and the port a free
    one. The first run failed with "field 'base_url': missing": nothing said what hosts the
    example envs."""
    _, model_url = model_server
    readme_lines = [w for n, w in command_lines() if n == "README.md"]
    serve = next(w for w in readme_lines if w[:1] == ["serve-env"])
    line = next(" ".join(w) for w in readme_lines if w[:2] == ["run", "tasks.yaml"])
    block = readme_block("yaml", "dataset: examples/data/arithmetic.jsonl")
    port = str(free_port())
    assert "--port" in serve and serve[serve.index("--port") + 1] in block, (serve, block)
    readme_port = serve[serve.index("--port") + 1]
    checkout = tmp_path / "checkout"  # the README's paths are the checkout's
    checkout.mkdir()
    (checkout / "examples").symlink_to(ROOT / "examples")
    (checkout / "tasks.yaml").write_text(block.replace(f":{readme_port}", f":{port}"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("INTERACTOR_") and k != "REDIS_URL"}
    env["PYTHONPATH"] = str(ROOT)
    served = [w.replace(readme_port, port) if w == readme_port else w for w in serve]
    server = subprocess.Popen([sys.executable, "-m", "interactor.cli", *served], cwd=str(checkout), env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        started = [server.stdout.readline() for _ in range(2)]
        assert "listening on" in started[1], started
        # the README's model server and model name are the reader's own (tests/test_real_model_readme.py
        # runs them against llama-server); here the stand-in's
        argv = [w.replace("http://127.0.0.1:8000/v1", model_url + "/v1").replace("your-model", "stand-in")
                for w in shlex.split(line)]
        out = subprocess.run([sys.executable, "-m", "interactor.cli", *argv, "--workers", "1"], cwd=str(checkout),
                             env=env, capture_output=True, text=True, timeout=300)
    finally:
        server.terminate()
        server.wait(10)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "preflight:" in out.stdout and "results database" in out.stdout
    job = re.search(r"^job (\S+): \d+ episodes", out.stdout, re.M).group(1)
    listed = subprocess.run([sys.executable, "-m", "interactor.cli", "jobs"], cwd=str(checkout), env=env,
                            capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0 and job in listed.stdout, listed.stdout + listed.stderr
    res = subprocess.run([sys.executable, "-m", "interactor.cli", "results", job, "--groups"], cwd=str(checkout),
                         env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "group_id" in res.stdout, res.stderr


@pytest.mark.integration
def test_the_readmes_trainer_loop_runs_against_a_feed(settings, redis_client, tmp_path):
    """The README's trainer snippet, as printed, for one round (its `while True` bounded and
    the two calls it leaves to the trainer defined), against a real feed server over HTTP."""
    from broker import feed
    from broker.keys import Keys
    from broker.ledger import Ledger
    from broker.records import FeedGroup, JobSpec
    from broker.states import FeedGroupStatus
    from consumer.storage import open_store
    from interactor.feed_service import FeedService
    from interactor.feedserve import FeedApp, make_server
    from tests.test_feed_http import one_step

    job = "readme-job"
    keys = Keys(settings.key_prefix)
    Ledger.for_settings(redis_client, settings).create_job(
        JobSpec(job_id=job, llm_base_url="http://llm/v1", model="m", episodes=0, groups=0), [])
    feed.enable(redis_client, keys, job, feed.FeedConfig(max_ahead=16))
    store = open_store(str(tmp_path / "results.sqlite"))
    for g in range(3):
        members = [f"g{g}.1", f"g{g}.2"]
        store.write_batch([one_step(job, ep, f"g{g}") for ep in members])
        feed.announce(redis_client, keys, FeedGroup(job_id=job, group_id=f"g{g}", status=FeedGroupStatus.READY,
                                                    members=members, rewards=[1.0, 0.0], size=2).pack(), job, f"g{g}")
    server = make_server(FeedApp(FeedService(redis_client, settings, job, store)), "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    snippet = readme_block("python", "Feed(")
    snippet = snippet.replace("http://127.0.0.1:8700", f"http://127.0.0.1:{server.server_address[1]}")
    assert "while True:" in snippet
    snippet = snippet.replace("while True:", "for _round in range(1):")
    # a take waits up to its timeout for the 8 groups it asks for; three are ready here
    assert "timeout=60" in snippet
    snippet = snippet.replace("timeout=60", "timeout=1")
    trained: list = []
    scope = {"train_on": trained.append, "push_weights_to_model_server": lambda: None}
    try:
        exec(compile(textwrap.dedent(snippet), "README.md", "exec"), scope)
    finally:
        server.shutdown()
        server.server_close()
        store.close()
    (batch,) = trained  # three groups of two one-step samples
    assert len(batch) == 6 and all(msgs == [] and resp == "r" and adv is not None for msgs, resp, adv in batch)
    st = feed.summary(redis_client, keys, job)
    assert st["acked"] == 3 and st["version"] == 1
