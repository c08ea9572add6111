"""How an environment of another protocol meets the step loop: its observation becomes the
prompt, a completion becomes its action (docs/environments.md#environments-from-other-ecosystems).

The defaults serve text environments without a line of adapter code:

* :func:`default_observation_to_messages`: an observation's ``messages`` (a list of chat
  messages: the env keeps the conversation), else its ``prompt`` (this turn's user message: the
  conversation so far, kept by the port, plus it), else its one string field (the template
  ``openenv init`` writes answers ``echoed_message``);
* :func:`default_completion_to_action`: the action schema's one string field (``/schema``'s
  ``action``, less ``metadata``) set to the completion's text.

A task entry may name its own instead (``observation_to_messages: module:function``,
``completion_to_action: module:function``), allowed by the worker's env class list
(``INTERACTOR_ENV_CLASSES``) as an env class is, and called with the same arguments as the
defaults. What they return is checked as any env answer is: a mapping that fails, or returns
something else, fails the episode with a reason that names it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from broker.errors import ENV_BAD_REQUEST, ENV_MALFORMED, EpisodeError
from envs.base import import_object
from workers.envport import check_prompt_answer

OBSERVATION_TO_MESSAGES = "observation_to_messages"
COMPLETION_TO_ACTION = "completion_to_action"
MAPPING_KEYS = (OBSERVATION_TO_MESSAGES, COMPLETION_TO_ACTION)

# Fields of an OpenEnv action every action has (openenv's types.Action): never the text's.
_ACTION_BASE_FIELDS = frozenset({"metadata"})


def default_observation_to_messages(observation: dict, conversation: list[dict]) -> list[dict]:
    """This turn's prompt from the env's observation. ``conversation``: the prompt of the turn
    before and the assistant's answer to it ([] after a reset)."""
    messages = observation.get("messages")
    if messages is not None:
        return messages
    prompt = observation.get("prompt")
    if prompt is None:
        texts = [name for name, value in observation.items() if isinstance(value, str)]
        if len(texts) != 1:
            raise EpisodeError(
                ENV_MALFORMED,
                "the observation has no 'messages' or 'prompt' field, nor a single string field "
                f"(fields: {', '.join(sorted(map(str, observation))) or 'none'}); name an observation_to_messages "
                "mapping (module:function) in the task entry", transient=False)
        prompt = observation[texts[0]]
    if not isinstance(prompt, (str, list)):
        raise EpisodeError(ENV_MALFORMED, f"the observation's prompt is a {type(prompt).__name__}, not a string "
                                          "or a list of content parts", transient=False)
    return [*conversation, {"role": "user", "content": prompt}]


def text_field(action_schema: dict) -> str:
    """The one string field of an action schema (JSON schema of the env's action class), which
    a completion's text fills; an error naming the fields when there is not exactly one."""
    props = action_schema.get("properties") if isinstance(action_schema, dict) else None
    if not isinstance(props, dict):
        raise EpisodeError(ENV_BAD_REQUEST, "the env's /schema has no action properties; name a "
                                            "completion_to_action mapping (module:function)", transient=False)
    fields = [name for name in props if name not in _ACTION_BASE_FIELDS]
    strings = [name for name in fields if isinstance(props[name], dict) and props[name].get("type") == "string"]
    if len(strings) != 1:
        raise EpisodeError(
            ENV_BAD_REQUEST,
            f"the env's action has {len(strings)} string fields (fields: {', '.join(fields) or 'none'}), not one "
            "a completion's text can fill; name a completion_to_action mapping (module:function) in the task entry",
            transient=False)
    return strings[0]


def default_completion_to_action(text: str, tool_calls: list | None, action_schema: dict) -> dict:
    """The action of a completion: its text in the action's one string field."""
    return {text_field(action_schema): text}


@dataclass(frozen=True)
class Mapping:
    """The two functions of one episode's entry, loaded."""

    observation_to_messages: Callable[[dict, list[dict]], Any] = default_observation_to_messages
    completion_to_action: Callable[[str, list | None, dict], Any] = default_completion_to_action

    @classmethod
    def load(cls, named: dict[str, str]) -> "Mapping":
        """The entry's functions (``EpisodeSpec.mapping``), imported: the worker's trust checks
        (workers/allowlist.py) have allowed them before this is called."""
        loaded = {}
        for key in MAPPING_KEYS:
            path = (named or {}).get(key)
            if path:
                try:
                    loaded[key] = import_object(path)
                except Exception as exc:  # noqa: BLE001 - an import error of the user's module
                    raise EpisodeError(ENV_BAD_REQUEST, f"{key} {path!r} could not be loaded: "
                                                        f"{type(exc).__name__}: {exc}", transient=False) from None
        return cls(**loaded)

    def messages(self, observation: dict, conversation: list[dict], what: str) -> list:
        """This turn's prompt, checked as a prompt answer is (workers/envport.py)."""
        try:
            messages = self.observation_to_messages(observation, conversation)
        except EpisodeError:
            raise
        except Exception as exc:  # noqa: BLE001 - the user's function
            raise EpisodeError(ENV_MALFORMED, f"{what}: observation_to_messages failed: {type(exc).__name__}: {exc}",
                               transient=False) from None
        return check_prompt_answer(messages, f"{what} (observation_to_messages)")

    def action(self, text: str, tool_calls: list | None, action_schema: dict, what: str) -> dict:
        """The action to send, checked to be a JSON object."""
        try:
            action = self.completion_to_action(text, tool_calls, action_schema)
        except EpisodeError:
            raise
        except Exception as exc:  # noqa: BLE001 - the user's function
            raise EpisodeError(ENV_BAD_REQUEST, f"{what}: completion_to_action failed: {type(exc).__name__}: {exc}",
                               transient=False) from None
        if not isinstance(action, dict):
            raise EpisodeError(ENV_BAD_REQUEST, f"{what}: completion_to_action returned a {type(action).__name__}, "
                                                "not an object", transient=False)
        return action
