"""Correcting a job's own settings when it is resumed: ``interactor run --resume JOB --model M``.

A job keeps the model, sampling and step settings it was created with (``JobSpec``, in Redis),
and its workers read them from there. A job that paused because of one of them (a wrong
``--model``, a ``--max-tokens`` too small for its answers) is resumed with the setting
corrected: the flag given to ``run --resume`` replaces the stored value, in Redis (what the
workers read from then on) and in the results store (the job's row, through the results stream,
as its creation was), and each change is said in one line. A corrected model or endpoint is
asked first, as preflight asks a new job's (``model_problems``): one that is still wrong leaves
the job as it was. Steps already taken keep what they were taken with (each step row names its
own model). Workers started before the correction (a fleet this run did not start) keep the
spec they read until they restart (workers/runner.py caches a job's spec per process).

What a resume cannot change is refused, with why: the env server of the job's episodes
(``--env-base-url``: each episode keeps its own ``base_url``) and the fleet-wide caps (resolved
per server at submit). A task file's mistake is corrected by running the corrected file as a
new job.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from broker.errors import parse_retry_on
from broker.keys import Keys
from broker.records import JobSpec
from broker.settings import Settings, SettingsError, redact_url

__all__ = ["CORRECTABLE", "REFUSED", "correction_flags", "corrected", "model_problems", "apply_corrections"]


def _param(name: str) -> Callable[[JobSpec, Any], None]:
    """A request field of ``llm_params``: set, or removed by the flag's "not sent" value."""
    def put(spec: JobSpec, value: Any) -> None:
        params = dict(spec.llm_params or {})
        if value in (0, 0.0, "", None):
            params.pop(name, None)
        else:
            params[name] = value
        spec.llm_params = params
    return put


def _stop(spec: JobSpec, value: str) -> None:
    stop: Any = value
    if value.lstrip().startswith("["):
        try:
            stop = json.loads(value)
        except ValueError:
            raise SettingsError(f"--stop must be one string or a JSON list of strings, got {value!r}") from None
    _param("stop")(spec, stop)


def _llm_params(spec: JobSpec, value: str) -> None:
    try:
        extra = json.loads(value) if value else {}
    except ValueError:
        extra = None
    if not isinstance(extra, dict):
        raise SettingsError(f"--llm-params must be a JSON object, got {value!r}")
    spec.llm_params = {**(spec.llm_params or {}), **extra}


def _field(name: str, convert: Callable[[Any], Any] = lambda v: v) -> Callable[[JobSpec, Any], None]:
    def put(spec: JobSpec, value: Any) -> None:
        setattr(spec, name, convert(value))
    return put


# Settings field -> how its value goes into the stored JobSpec (producer/enqueue.py job_spec).
CORRECTABLE: dict[str, Callable[[JobSpec, Any], None]] = {
    "model": _field("model"),
    "llm_base_url": _field("llm_base_url"),
    "temperature": _field("temperature", float),
    "llm_max_tokens": _param("max_tokens"),
    "llm_top_p": _param("top_p"),
    "llm_stop": _stop,
    "llm_params": _llm_params,
    "llm_session_routing": _field("session_routing", bool),
    "tokens": _field("tokens", lambda v: Settings(tokens=v).tokens),
    "max_steps": _field("max_steps", int),
    "message_cut": _field("message_cut", int),
    "episode_budget_s": _field("episode_budget_s", float),
    "episode_hook": _field("episode_hook"),
    "max_attempts": _field("max_attempts", int),
    "pause_after_failures": _field("pause_after_failures", int),
    "no_resume": _field("resume", lambda v: not v),
    "retry_on": _field("retry_on", parse_retry_on),  # checked with the settings (broker/settings_checks.py)
}

# Settings field -> why a resume cannot change it.
REFUSED: dict[str, str] = {
    "env_base_url": "each episode keeps the env server it was planned with",
    "llm_fleet_max_concurrency": "a running job's model limits change with `interactor job JOB set --concurrency N`",
    "llm_fleet_rpm": "a running job's model limits change with `interactor job JOB set --llm-fleet-rpm N`",
    "llm_fleet_tpm": "a running job's model limits change with `interactor job JOB set --llm-fleet-tpm N`",
    "llm_metrics_url": "the model server's metrics endpoint is fixed at submit",
    "env_fleet_max_concurrency": "the job's fleet-wide caps are fixed at submit",
    "env_fleet_max_instances": "the job's fleet-wide caps are fixed at submit",
    "cache": "the response cache is chosen at submit, where a sampled job is refused it",
}


def correction_flags(args, job_flags: dict) -> dict[str, Any]:
    """The job settings this command line gives (settings field -> value), to correct the job
    with; ``job_flags``: flag -> field of the job's settings. A flag a resume cannot apply is
    refused (``SettingsError`` naming it and why)."""
    given = {f.name: getattr(args, f.name) for f in job_flags.values() if getattr(args, f.name, None) is not None}
    typed = Settings.from_env({}, **given)  # each value as its setting reads it (--max-tokens 64: an int)
    given = {name: getattr(typed, name) for name in given}
    refused = [f"{flag} ({REFUSED[f.name]})" for flag, f in job_flags.items()
               if f.name in given and f.name in REFUSED]
    unknown = [flag for flag, f in job_flags.items() if f.name in given and f.name not in REFUSED
               and f.name not in CORRECTABLE]
    if refused or unknown:
        why = "; ".join(refused + [f"{flag} (not a setting a resume changes)" for flag in unknown])
        raise SettingsError(f"run --resume {args.resume}: cannot change {why}. Run the task files as a new job "
                            "to change them")
    return given


def _shown(field: str, spec: JobSpec) -> str:
    name = _label(field)
    if name == "llm_params":
        return json.dumps(spec.llm_params or {}, sort_keys=True)
    value = getattr(spec, name)
    return redact_url(value) if field == "llm_base_url" else repr(value)


def corrected(spec: JobSpec, corrections: dict[str, Any]) -> JobSpec:
    """A copy of ``spec`` with ``corrections`` laid over it."""
    new = JobSpec.from_dict(spec.to_dict())
    for field, value in corrections.items():
        CORRECTABLE[field](new, value)
    return new


def model_problems(settings: Settings, spec: JobSpec, corrections: dict[str, Any]) -> list[str]:
    """When the corrections change the job's model or endpoint: what preflight finds wrong with
    the corrected pair (interactor/preflight.py; a model the server does not list, a server that
    does not answer), before anything is written."""
    new = corrected(spec, corrections)
    if (new.model, new.llm_base_url) == (spec.model, spec.llm_base_url):
        return []
    from interactor.preflight import ask

    return [str(p) for p in ask(settings.replace(model=new.model, llm_base_url=new.llm_base_url), []).problems]


def apply_corrections(client, settings: Settings, spec: JobSpec, corrections: dict[str, Any]) -> list[str]:
    """Lay ``corrections`` over the job's stored spec: written to Redis (what its workers read)
    and to the results stream (the store's job row); returns one line per change, or one saying
    that nothing changed."""
    new = corrected(spec, corrections)
    changes = []
    for field in corrections:
        before, after = _shown(field, spec), _shown(field, new)
        if before != after and not any(c.startswith(_label(field)) for c in changes):
            changes.append(f"{_label(field)}: {before} -> {after}")
    if not changes:
        return [f"job {spec.job_id}: its settings already are those given; nothing changed"]
    keys = Keys(settings.key_prefix)
    packed = new.pack()
    pipe = client.pipeline(transaction=True)
    pipe.set(keys.job_spec(spec.job_id), packed, keepttl=True)
    pipe.xadd(keys.results, {"r": packed})
    pipe.execute()
    return [f"job {spec.job_id}'s settings corrected for what runs from now on (steps taken keep theirs): "
            + "; ".join(changes)]


def _label(field: str) -> str:
    """The JobSpec field a setting lands in, as the change is said."""
    if field.startswith("llm_") and field not in ("llm_base_url", "llm_session_routing"):
        return "llm_params"
    return {"llm_session_routing": "session_routing", "no_resume": "resume"}.get(field, field)
