"""The command line's help: every option and positional of every command (recursively: dlq's and
feed's actions, ``python -m bench``'s bench, the model stand-in's own flags) says what it does,
every flag with a default says it, and each command offers only the settings it reads, with the
help, group and default that broker/settings.py gives each setting once."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

from broker import feed
from broker.settings import Settings
from interactor.cli import build_parser
from interactor.common import SETTING_FLAGS

pytestmark = pytest.mark.unit  # needs no server: make check runs it

ROOT = Path(__file__).resolve().parent.parent

# --run-dir: without REDIS_URL, the embedded Redis of a local run still running there
REDIS_FLAGS = {"--redis-url", "--key-prefix", "--queue", "--queues", "--lease-ttl", "--run-dir"}
STORE_FLAGS = {"--run-dir", "--db", "--store"}
FEED_FLAGS = {"--max-ahead", "--max-staleness", "--stale-policy", "--failed-policy", "--refill-max", "--ack-timeout",
              "--drop-uniform", "--filter", "--host", "--port"}


def commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ("interactor",)):
    """``(path, parser)`` of ``parser`` and of every command under it."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from commands(sub, (*path, name))


def every_parser():
    from bench.bench_command import register
    from examples.model_standin import build_parser as standin_parser

    yield from commands(build_parser())
    yield from commands(build_parser([register]), ("python -m bench",))
    yield ("interactor", "serve-model", "(the stand-in)"), standin_parser("interactor serve-model")


def command(*path: str) -> argparse.ArgumentParser:
    return dict(commands(build_parser()))[("interactor", *path)]


def setting_flags(parser: argparse.ArgumentParser) -> set[str]:
    return {o for a in parser._actions if a.dest in SETTING_FLAGS.values() for o in a.option_strings
            if o in SETTING_FLAGS}


def option(parser: argparse.ArgumentParser, flag: str) -> argparse.Action:
    return parser._option_string_actions[flag]


def help_text(*args: str) -> str:
    """What ``interactor ARGS`` prints, as one line (help wraps at any space)."""
    out = subprocess.run([sys.executable, "-m", "interactor.cli", *args], cwd=str(ROOT), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return " ".join(out.stdout.split())


def test_every_option_and_positional_of_every_command_says_what_it_does():
    missing = []
    for path, parser in every_parser():
        name = " ".join(path)
        if parser.add_help and not parser.description:
            missing.append(f"{name}: no description")
        for a in parser._actions:
            if a.help == argparse.SUPPRESS:  # a hidden alias (--tokens=MODE arrives as --tokens-value)
                continue
            if isinstance(a, argparse._SubParsersAction):  # each command's line in the list
                missing += [f"{name} {c.dest}" for c in a._choices_actions if not (c.help or "").strip()]
                continue
            if not (a.help or "").strip():
                missing.append(f"{name} {'/'.join(a.option_strings) or a.dest}")
    assert not missing, "no help: " + ", ".join(missing)


def test_every_flag_with_a_default_says_it():
    silent = []
    for path, parser in every_parser():
        for a in parser._actions:
            if not a.option_strings or a.help == argparse.SUPPRESS or isinstance(a, argparse._HelpAction):
                continue
            if a.dest in SETTING_FLAGS.values():  # None until given: the default is the setting's
                says = "(default: " in a.help
            else:
                says = a.default in (None, False, []) or "default" in a.help
            if not says:
                silent.append(f"{' '.join(path)} {a.option_strings[0]}")
    assert not silent, "default not said: " + ", ".join(silent)


def test_each_command_offers_only_the_settings_it_reads():
    for path in (("results",), ("export",)):
        assert setting_flags(command(*path)) == STORE_FLAGS, path
    for path in (("status",), ("metrics",), ("resume",), ("reconcile",)):
        assert setting_flags(command(*path)) == REDIS_FLAGS, path
    for action in ("list", "show", "redrive", "purge"):  # a re-drive's attempts too
        assert setting_flags(command("dlq", action)) == REDIS_FLAGS | {"--max-attempts"}, action
    assert setting_flags(command("ui")) == STORE_FLAGS | REDIS_FLAGS | {"--max-attempts"}
    assert setting_flags(command("consumer")) == REDIS_FLAGS | STORE_FLAGS
    # A job's settings are the producer's; a worker takes them from the job, and its own are not.
    job_only = {"--model", "--temperature", "--message-cut", "--max-steps", "--tokens", "--llm-params",
                "--env-base-url", "--llm-fleet-rpm", "--pause-after-failures"}
    process_only = {"--concurrency", "--pool", "--llm-timeout", "--env-retries", "--shutdown-grace"}
    for path in (("worker",), ("autoscale",)):
        flags = setting_flags(command(*path))
        assert process_only | REDIS_FLAGS <= flags and not flags & (job_only | (STORE_FLAGS - REDIS_FLAGS)), path
    flags = setting_flags(command("submit"))
    assert job_only | REDIS_FLAGS <= flags and not flags & (process_only | (STORE_FLAGS - REDIS_FLAGS))
    # What runs everything here offers every setting flag; the feed server its own besides.
    for path in (("run",), ("demo",)):
        assert setting_flags(command(*path)) == set(SETTING_FLAGS) - FEED_FLAGS, path
    assert setting_flags(command("feed", "serve")) == set(SETTING_FLAGS)


def test_export_help_offers_no_model_flag_and_run_help_says_the_prompt_trimming():
    shown = help_text("export", "--help")
    assert "--temperature" not in shown and "[--tokens]" not in shown and "[--store STORE]" in shown
    run = help_text("run", "--help")
    cut = run[run.rindex("--message-cut N"):]  # its entry, after the usage line
    assert cut.index("2*N-1 messages") < cut.index("(default: 3; INTERACTOR_MESSAGE_CUT)") < 400, cut[:400]
    assert "0 sends the whole history" in cut[:400]
    assert "storage: where the fleet's Redis" in run and "limits: fleet-wide" in run  # the groups


def test_concurrency_says_whether_it_is_a_total_or_per_process():
    for path in (("run",), ("demo",), ("feed", "serve")):
        assert "in all, split between the local worker processes" in option(command(*path), "--concurrency").help
    for path in (("worker",), ("autoscale",)):
        assert option(command(*path), "--concurrency").help.startswith("episodes at once per worker process")


def test_the_overview_lists_every_command():
    p = build_parser()
    (sub,) = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
    listed = set(re.findall(r"^  interactor ([a-z-]+)", p.description, re.M))
    assert listed == set(sub.choices)


def test_serve_model_help_names_the_command():
    assert help_text("serve-model", "--help").startswith("usage: interactor serve-model [-h]")


def test_a_feed_knob_is_one_setting():
    """FeedConfig's knobs are the settings feed_<knob>, with their defaults; the flags feed serve
    refuses with --job are theirs."""
    from interactor.feedcmd import FEED_SETTINGS

    defaults = Settings.from_env({})
    config = feed.FeedConfig()
    assert feed.KNOBS == tuple(f for f in config.__dataclass_fields__)[:len(feed.KNOBS)]
    assert all(getattr(config, k) == getattr(defaults, "feed_" + k) for k in feed.KNOBS)
    refused = {flag for flag, name in SETTING_FLAGS.items() if name in FEED_SETTINGS}
    assert refused == FEED_FLAGS - {"--host", "--port"}


def test_tokens_stands_bare_or_with_a_value_where_it_is_offered(capsys):
    for path in (("run",), ("submit",), ("feed", "serve")):
        assert build_parser().parse_args([*path, "--tokens", "t.yaml"]).tokens == "auto"
        assert build_parser().parse_args([*path, "--tokens=sglang", "t.yaml"]).tokens == "sglang"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["status", "--tokens=vllm"])
    assert "unrecognized arguments: --tokens=vllm" in capsys.readouterr().err


def test_no_flag_of_a_command_stands_for_a_setting_it_is_not():
    """settings_from_args reads a setting from the attribute of its name: a command's own flag
    with such a name would set it unasked."""
    for path, parser in every_parser():
        for a in parser._actions:
            if a.dest in SETTING_FLAGS.values():
                assert set(a.option_strings) <= set(SETTING_FLAGS) | {f + "-value" for f in SETTING_FLAGS}, path


def test_building_the_parser_loads_no_heavy_library():
    """`interactor --help` stays quick: the commands import what they run when they run."""
    code = ("import sys\nimport interactor.cli\ninteractor.cli.build_parser()\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'celery', 'kombu', 'gevent', 'flask', 'pyarrow', "
            "'requests', 'psycopg', 'consumer', 'workers', 'producer'}))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=str(ROOT), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr
