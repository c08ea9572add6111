"""Before a job is enqueued: is anybody there?

A typo in a port made `interactor run` print ``running=2 ... 0.0 steps/s`` for minutes: the
workers' breakers knew the server was down and waited it out, as they should for an outage,
but the user was never told. An outage that starts before the job is almost always a wrong
URL or a server not started yet, so `run` and `submit` ask every server once before they
enqueue anything and refuse with one line per problem (`--no-preflight` skips it, for servers
that start later).

What is asked, and why it is enough:
* the model endpoint: ``GET {llm_base_url}/models`` (the readiness call every OpenAI-style
  server answers). A server that answers at all is up; 404, 405 or 501 there means it has no
  such route (a gateway without GET routes, Python's http.server answers 501), which is no
  reason to refuse. When the model named is not among the ids listed, one ``max_tokens: 1``
  request tells "does not exist" (vLLM, SGLang, OpenAI answer 404) from a server that takes any
  name (llama.cpp's llama-server lists its file name and serves whatever is asked). Not behind
  session routing, where every request belongs to an episode's session. ``--model`` left at its
  default (``stand-in``, the bundled stand-in's name) against a server that lists other models
  is refused, naming them: llama-server would serve it and label real results ``stand-in``.
* each env server: ``GET {base_url}/envs`` (the protocol's readiness call,
  docs/protocol.md#what-get-envs-answers). Where it answers a list of names, an ``env_name`` is
  served when it is listed or the part before its first dot is (``serve-env`` lists
  ``reasoning_gym`` and serves ``reasoning_gym.leg_counting``); any other is a problem too.
* each server of another protocol (a task entry's ``protocol``): an OpenEnv server answers
  ``GET /health`` and ``GET /metadata`` (``create_app`` serves both); an ORS server ``GET
  /list_environments``, which must list the entry's ``env_name``. A server that speaks
  something else is named in one line (an ORS server has no ``/metadata``, an OpenEnv server no
  ``/list_environments``, a server of the original protocol neither).
* each inproc ``env_class``, and each ``observation_to_messages`` / ``completion_to_action``:
  on the workers' allow-list (``env_classes``), or every episode of it would be dead-lettered as
  ``bad_task``; likewise each agent episode's ``agent`` and ``agent_command`` (``agents``,
  ``agent_commands``).

The API key goes only where the workers would send it (``Settings.trusted_model_origins``).
When every server answered, :func:`gate` says in one line what was asked and how it answered.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from typing import TextIO

import requests

from broker.settings import Settings, origin_of, redact_url
from broker.states import EnvProtocol

PROBE_TIMEOUT_S = 5.0
NO_PREFLIGHT_HINT = "(--no-preflight skips this check, for servers that start later)"
# What a server with no GET /models route answers: 404, 405 (some gateways), 501 (Python's
# http.server without do_GET). The server answered: it is up.
NO_ROUTE_STATUSES = (404, 405, 501)
SUMMARY_ENV_SERVERS = 3  # env servers named in the summary line; the rest are counted
# --model's default, the name the bundled stand-in serves. Against a server that lists other
# names it is a forgotten --model, refused rather than guessed: a server that takes any name
# (llama-server) would run the job, and its results would be labelled "stand-in".
DEFAULT_MODEL = next(f.default for f in dataclasses.fields(Settings) if f.name == "model")


@dataclass(frozen=True)
class Problem:
    """One server a job cannot use, in one line."""

    kind: str  # "model", "env" (a server), "env_class" (an inproc class) or "agent" (an agent episode's)
    url: str  # redacted; the class's module:Class for an env_class
    what: str

    def __str__(self) -> str:
        return f"{self.kind if self.kind in ('env_class', 'agent') else self.kind + ' server'} {self.url}: {self.what}"


def _reason(exc: requests.RequestException) -> str:
    """``connection refused`` rather than urllib3's nested repr of it."""
    text = str(exc)
    for sign, short in (("Connection refused", "connection refused"),
                        ("Name or service not known", "host name not found"),
                        ("nodename nor servname", "host name not found"),
                        ("Temporary failure in name resolution", "host name not found"),
                        ("timed out", f"no answer within {PROBE_TIMEOUT_S:g} s"),
                        ("CERTIFICATE_VERIFY_FAILED", "TLS certificate not trusted")):
        if sign in text:
            return short
    return f"{type(exc).__name__}: {text[:200]}"


def _error_text(resp: requests.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:200].strip()
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        return str(err.get("message") or err)[:200]
    return str(err or body)[:200]


@dataclass
class Outcome:
    """What the servers answered: the problems, and how each server that answered did."""

    problems: list[Problem] = field(default_factory=list)
    model_answer: str = ""  # e.g. "GET /models: 501, no such route"
    model_url: str = ""  # redacted
    env_urls: list[str] = field(default_factory=list)  # redacted, those that answered

    def summary(self) -> str:
        """One line: what was asked and how it answered."""
        parts = [f"model server {self.model_url} answers ({self.model_answer})"]
        if self.env_urls:
            named = ", ".join(self.env_urls[:SUMMARY_ENV_SERVERS])
            more = len(self.env_urls) - SUMMARY_ENV_SERVERS
            if more > 0:
                named += f" and {more} more"
            parts.append(f"env server {named} answers (GET /envs)" if len(self.env_urls) == 1 else
                         f"env servers {named} answer (GET /envs)")
        return "preflight: " + ", ".join(parts)


class Preflight:
    def __init__(self, settings: Settings, *, timeout_s: float = PROBE_TIMEOUT_S):
        self.settings = settings
        self.timeout_s = timeout_s
        self.session = requests.Session()
        self.session.trust_env = False  # as the workers' clients: no proxy variables, no .netrc
        self.model_answer = ""  # how GET /models answered, once it did

    def close(self) -> None:
        self.session.close()

    # --- model -------------------------------------------------------------------------
    def model(self) -> list[Problem]:
        s = self.settings
        base = s.llm_base_url.rstrip("/")
        shown = redact_url(base)
        headers = {}
        key = s.llm_api_key.reveal()
        if key and origin_of(base) in s.trusted_model_origins():
            headers["Authorization"] = f"Bearer {key}"
        try:
            resp = self.session.get(base + "/models", headers=headers, timeout=self.timeout_s)
        except requests.RequestException as exc:
            return [Problem("model", shown, f"unreachable: {_reason(exc)}")]
        self.model_answer = f"GET /models: {resp.status_code}"
        if resp.status_code in (401, 403):
            return [Problem("model", shown, f"refused the API key (HTTP {resp.status_code}: {_error_text(resp)})")]
        if resp.status_code in NO_ROUTE_STATUSES:
            self.model_answer += ", no such route"
            return []  # nothing more to learn without spending a request
        if resp.status_code >= 400:
            return [Problem("model", shown, f"answers HTTP {resp.status_code} to GET /models: {_error_text(resp)}")]
        try:
            listed = [m.get("id") for m in resp.json().get("data", []) if isinstance(m, dict)]
        except (ValueError, AttributeError):
            return []
        if not listed or s.model in listed or s.llm_session_routing:
            return []  # (a session-routing proxy sees every request as part of an episode's session)
        if s.model == DEFAULT_MODEL:
            return [Problem("model", shown, f"serves {', '.join(map(str, listed[:8]))}"
                                            f"{' ...' if len(listed) > 8 else ''}, and no --model was given (the "
                                            f"default {DEFAULT_MODEL!r} is the bundled stand-in's): pass --model "
                                            f"{listed[0]} (INTERACTOR_MODEL), the name results are labelled with")]
        return self._model_exists(base, headers, shown, listed)

    def _model_exists(self, base: str, headers: dict, shown: str, listed: list) -> list[Problem]:
        body = {"model": self.settings.model, "max_tokens": 1,
                "messages": [{"role": "user", "content": "ping"}]}
        try:
            resp = self.session.post(base + "/chat/completions", json=body, headers=headers, timeout=self.timeout_s)
        except requests.RequestException as exc:
            return [Problem("model", shown, f"unreachable: {_reason(exc)}")]
        if resp.status_code == 404 or (resp.status_code == 400 and "model" in _error_text(resp).lower()):
            served = ", ".join(str(m) for m in listed[:5])
            return [Problem("model", shown, f"has no model {self.settings.model!r} "
                                            f"(it serves {served}): {_error_text(resp)}")]
        return []

    # --- env servers ---------------------------------------------------------------------
    def env(self, base_url: str, env_names: set[str]) -> list[Problem]:
        base = base_url.rstrip("/")
        shown = redact_url(base)
        try:
            resp = self.session.get(base + "/envs", timeout=self.timeout_s)
        except requests.RequestException as exc:
            return [Problem("env", shown, f"unreachable: {_reason(exc)}")]
        if resp.status_code >= 400:
            return [Problem("env", shown, f"answers HTTP {resp.status_code} to GET /envs: {_error_text(resp)}")]
        try:
            served = resp.json()
        except ValueError:
            return []
        if isinstance(served, dict):
            served = served.get("envs", served.get("env_names"))
        if not isinstance(served, list) or not served or not all(isinstance(n, str) for n in served):
            return []  # a server that does not list its envs: the first reset will tell
        missing = sorted(n for n in env_names if not serves(served, n))
        if missing:
            return [Problem("env", shown, f"does not serve env_name {', '.join(map(repr, missing))}: GET /envs "
                                          f"lists {', '.join(served[:8])}{' ...' if len(served) > 8 else ''}, and "
                                          "an env_name is served when it, or the part before its first dot, is "
                                          "listed (docs/protocol.md#what-get-envs-answers)")]
        return []


    def protocol_env(self, base_url: str, protocol: str, env_names: set[str]) -> list[Problem]:
        """A server of ``protocol`` (broker/states.py EnvProtocol), asked as the module says."""
        base = base_url.rstrip("/")
        shown = redact_url(base)
        asks = {EnvProtocol.OPENENV: ("/health", "/metadata"), EnvProtocol.ORS: ("/list_environments",)}[protocol]
        answers = []
        for route in asks:
            try:
                resp = self.session.get(base + route, timeout=self.timeout_s)
            except requests.RequestException as exc:
                return [Problem("env", shown, f"unreachable: {_reason(exc)}")]
            if resp.status_code >= 400:
                other = "an ORS server answers /list_environments, an OpenEnv server /metadata"
                return [Problem("env", shown, f"does not speak protocol {protocol}: GET {route} answers HTTP "
                                              f"{resp.status_code} ({other}; an entry without protocol: speaks "
                                              "the original protocol)")]
            answers.append(resp)
        if protocol == EnvProtocol.ORS:
            try:
                listed = answers[0].json()
            except ValueError:
                listed = None
            if not isinstance(listed, list) or not all(isinstance(n, str) for n in listed):
                return [Problem("env", shown, "does not speak protocol ors: GET /list_environments is not a list "
                                              "of names")]
            missing = sorted(n for n in env_names if n.lower() not in listed)
            if missing:
                return [Problem("env", shown, f"does not serve env_name {', '.join(map(repr, missing))}: GET "
                                              f"/list_environments lists {', '.join(listed[:8]) or 'nothing'}")]
        return []


def serves(listed: list[str], env_name: str) -> bool:
    """Whether a server whose ``GET /envs`` lists ``listed`` serves ``env_name``: listed as it
    is, or its family (the part before the first dot) is, as serve-env routes
    (``envs.adapter_for``)."""
    return env_name in listed or env_name.split(".", 1)[0] in listed


def env_classes(settings: Settings, episodes) -> list[Problem]:
    """Inproc episodes whose ``env_class`` the workers would refuse to import: the allow-list
    (``env_classes``) as set here, which a local run's workers share."""
    from workers.allowlist import env_class_allowlist

    allowed = env_class_allowlist(settings.env_classes)
    named = {e.env_class for e in episodes if e.transport == "inproc"}
    named |= {path for e in episodes for path in (getattr(e, "mapping", None) or {}).values()}
    refused = sorted(c for c in named if not allowed.allows(c))
    return [Problem("env_class", c, f"not on the workers' allow-list (INTERACTOR_ENV_CLASSES: {allowed}): "
                              f"every episode would fail as bad_task; allow it with INTERACTOR_ENV_CLASSES={c} "
                              "(comma-separated patterns, e.g. mymodule:*)") for c in refused]


def agents(settings: Settings, episodes) -> list[Problem]:
    """Agent episodes whose agent function or command the workers would refuse to run: their
    allow-lists (``agents``, ``agent_commands``) as set here, which a local run's workers share."""
    from workers.allowlist import CommandAllowlist, PathAllowlist

    functions, commands = PathAllowlist(settings.agents), CommandAllowlist(settings.agent_commands)
    named = sorted({e.agent for e in episodes if getattr(e, "agent", "")})
    argvs = sorted({tuple(e.agent_command) for e in episodes if getattr(e, "agent_command", None)})
    why = "every episode would fail as bad_task; allow it with"
    return ([Problem("agent", a, f"not on the workers' allow-list (INTERACTOR_AGENTS: {functions}): {why} "
                                 f"INTERACTOR_AGENTS={a} (comma-separated patterns, e.g. mypkg.agents:*)")
             for a in named if not functions.allows(a)]
            + [Problem("agent", " ".join(c), f"not on the workers' allow-list (INTERACTOR_AGENT_COMMANDS: {commands}): "
                                             f"{why} INTERACTOR_AGENT_COMMANDS='{' '.join(c)}' (comma-separated argv "
                                             "prefixes)") for c in argvs if not commands.allows(list(c))])


def ask(settings: Settings, episodes, *, timeout_s: float = PROBE_TIMEOUT_S) -> Outcome:
    """Ask the model endpoint and the env servers these episodes use (``EpisodeSpec`` s;
    inproc episodes call no env server)."""
    by_server: dict[tuple[str, str], set[str]] = {}
    for e in episodes:
        if e.transport != "inproc" and e.base_url:
            by_server.setdefault((e.base_url.rstrip("/"), getattr(e, "protocol", "")), set()).add(e.env_name)
    probe = Preflight(settings, timeout_s=timeout_s)
    out = Outcome(model_url=redact_url(settings.llm_base_url.rstrip("/")))
    try:
        out.problems = env_classes(settings, episodes) + agents(settings, episodes) + probe.model()
        out.model_answer = probe.model_answer
        for (url, protocol), names in sorted(by_server.items()):
            found = probe.protocol_env(url, protocol, names) if protocol else probe.env(url, names)
            out.problems += found
            if not found:
                out.env_urls.append(redact_url(url))
    finally:
        probe.close()
    return out


def check(settings: Settings, episodes, *, timeout_s: float = PROBE_TIMEOUT_S) -> list[Problem]:
    """Every problem found with the model endpoint and the env servers these episodes use."""
    return ask(settings, episodes, timeout_s=timeout_s).problems


def gate(settings: Settings, episodes, *, summary_to: TextIO) -> bool:
    """`run` and `submit`: ask the servers, then print the refusal (to stderr; False: enqueue
    nothing) or the one line of what answered (to ``summary_to``; True)."""
    out = ask(settings, episodes)
    if out.problems:
        print(f"interactor: {refusal(out.problems)}", file=sys.stderr)
        return False
    print(out.summary(), file=summary_to, flush=True)
    return True


def refusal(problems: list[Problem]) -> str:
    """The text `run` and `submit` print before exiting 2."""
    lines = [str(p) for p in problems]
    return ("nothing was enqueued: " + lines[0] if len(lines) == 1 else
            "nothing was enqueued:\n  " + "\n  ".join(lines)) + "\n" + NO_PREFLIGHT_HINT
