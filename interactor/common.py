"""What every command of the command line shares: the setting flags, settings from parsed
arguments, and a Redis client (used by cli, ops, ui, bench)."""

from __future__ import annotations

import argparse

from broker.settings import Settings

__all__ = ["SETTING_FLAGS", "add_setting_flags", "settings_from_args", "redis_for"]

# flag -> settings field; every flag is optional and overrides INTERACTOR_* variables.
SETTING_FLAGS = {
    "--redis-url": "redis_url", "--run-dir": "run_dir", "--db": "db_path", "--store": "store_url",
    "--queue": "queue",
    "--queues": "queues", "--llm-base-url": "llm_base_url", "--model": "model",
    "--temperature": "temperature", "--env-base-url": "env_base_url", "--max-steps": "max_steps",
    "--message-cut": "message_cut", "--episode-budget": "episode_budget_s", "--max-attempts": "max_attempts",
    "--lease-ttl": "lease_ttl_s", "--concurrency": "concurrency", "--pool": "pool",
    "--episode-hook": "episode_hook", "--llm-params": "llm_params", "--shutdown-grace": "shutdown_grace_s",
    "--llm-retries": "llm_retries", "--env-retries": "env_retries", "--key-prefix": "key_prefix",
    "--max-tokens": "llm_max_tokens", "--top-p": "llm_top_p", "--stop": "llm_stop",
    "--llm-connect-timeout": "llm_connect_timeout_s", "--llm-timeout": "llm_read_timeout_s",
    "--llm-max-connections": "llm_max_connections", "--llm-max-concurrency": "llm_max_concurrency",
    "--llm-startup-jitter": "llm_startup_jitter_s",
    "--experience-dir": "experience_dir", "--experience-top-k": "experience_top_k",
    "--tokens": "tokens",
    "--pause-after-failures": "pause_after_failures", "--llm-fleet-max-concurrency": "llm_fleet_max_concurrency",
    "--env-fleet-max-concurrency": "env_fleet_max_concurrency", "--env-fleet-max-instances": "env_fleet_max_instances",
    "--llm-fleet-rpm": "llm_fleet_rpm", "--llm-fleet-tpm": "llm_fleet_tpm",
}
# Setting flags that may be given bare: the value they then stand for.
_BARE = {"--tokens": "auto"}  # --tokens = ask in the way the server's answer shows (broker/tokens.py)
_BARE_HELP = {"--tokens": "store the token ids and logprobs the model sampled; --tokens=vllm|sglang|llama.cpp|openai "
                          "names the server's way of answering (bare: told from the answer)"}


def add_setting_flags(p: argparse.ArgumentParser, names: list[str]) -> None:
    for flag in names:
        if flag in _BARE:
            # Bare it stands for its default; with a value only as --flag=VALUE. An optional
            # value (nargs="?") would swallow the next word: `run --tokens tasks.yaml` read
            # tasks.yaml as the mode.
            p.add_argument(flag, dest=SETTING_FLAGS[flag], default=None, action="store_const", const=_BARE[flag],
                           help=_BARE_HELP.get(flag))
            p.add_argument(_valued(flag), dest=SETTING_FLAGS[flag], default=None, help=argparse.SUPPRESS)
        else:
            p.add_argument(flag, dest=SETTING_FLAGS[flag], default=None)


def _valued(flag: str) -> str:
    return flag + "-value"


class ArgumentParser(argparse.ArgumentParser):
    """Reads ``--flag=VALUE`` of a flag that may also stand bare (see :func:`add_setting_flags`)."""

    def parse_known_args(self, args=None, namespace=None):
        import sys

        args = list(sys.argv[1:] if args is None else args)
        out = []
        for a in args:
            flag, eq, value = a.partition("=")
            out += [_valued(flag), value] if eq and flag in _BARE else [a]
        return super().parse_known_args(out, namespace)


def settings_from_args(args: argparse.Namespace) -> Settings:
    """INTERACTOR_* variables, overridden by whichever setting flags were given."""
    overrides = {field: getattr(args, field) for field in SETTING_FLAGS.values() if getattr(args, field, None) is not None}
    if getattr(args, "llm_session_routing", False):
        overrides["llm_session_routing"] = True
    return Settings.from_env(**overrides)


def redis_for(settings: Settings):
    from broker.redisconn import connect

    return connect(settings)
