"""Environment adapters: existing environment libraries behind the env-class contract
(:mod:`envs.base`), usable both ways:

* over HTTP: ``interactor serve-env`` hosts them (docs/protocol.md#environment-server) for any worker fleet;
* in process: a task entry with ``env_class: envs.textarena_env:TextArenaEnv``
  (``transport: inproc``) runs them inside the worker.

=================  ===============================================  =======================
env_name           class                                            needs
=================  ===============================================  =======================
``reasoning_gym``  :class:`~.reasoning_gym_env.ReasoningGymEnv`     ``pip install 'reasoning-gym>=0.1'``
``textarena``      :class:`~.textarena_env.TextArenaEnv`            ``pip install 'textarena>=0.7'``
``guess_number``   :class:`~.bundled.BundledEnv` (the stand-ins)    nothing
``arithmetic``     :class:`~.bundled.BundledEnv`                    nothing
=================  ===============================================  =======================

An env_name may carry a default task after a dot: ``reasoning_gym.leg_counting``,
``textarena.GuessTheNumber-v0`` (so results and exports are split per task).
"""

from __future__ import annotations

import importlib.util

ADAPTERS: dict[str, str] = {
    "reasoning_gym": "envs.reasoning_gym_env:ReasoningGymEnv",
    "textarena": "envs.textarena_env:TextArenaEnv",
    "guess_number": "envs.bundled:BundledEnv",
    "arithmetic": "envs.bundled:BundledEnv",
}

# The library each adapter needs (import name), for `serve-env` to skip what is not installed.
REQUIRES: dict[str, str] = {"reasoning_gym": "reasoning_gym", "textarena": "textarena"}
# What pip installs for it: the library's own PyPI name, as pyproject.toml's extra of the same
# name pins it. Not ``interactor[...]``: "interactor" on PyPI is an unrelated project, and a
# trainer's environment away from this checkout has no ``.`` to install from.
PIP_REQUIREMENTS: dict[str, str] = {"reasoning_gym": "reasoning-gym>=0.1", "textarena": "textarena>=0.7"}


def install_hint(name: str) -> str:
    """How to install the library adapter ``name`` needs, where it is missing."""
    extra = name.replace("_", "-")
    return f"pip install '{PIP_REQUIREMENTS[name]}' (in a checkout of interactor: pip install -e '.[{extra}]')"


def adapter_for(env_name: str, registry: dict[str, str] | None = None) -> str | None:
    """The class path serving ``env_name``: an exact name, else the part before the first dot."""
    reg = ADAPTERS if registry is None else registry
    if env_name in reg:
        return reg[env_name]
    head = env_name.split(".", 1)[0]
    return reg.get(head) if head != env_name else None


def installed(name: str) -> bool:
    module = REQUIRES.get(name)
    if module is None:
        return True
    try:
        return importlib.util.find_spec(module) is not None
    except ValueError:  # in sys.modules as None: importing it is blocked here
        return False
