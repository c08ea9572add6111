"""The env port of an episode whose server speaks another protocol than the original's
(``EpisodeSpec.protocol``, broker/states.py ``EnvProtocol``): which port, built from what.

The attempt asks :func:`protocol_env_port` for its env port when ``spec.protocol`` is set; the
step loop drives it as it drives the original protocol's (reset / get_task_prompt / step /
close, under the attempt's budget and the server's breaker, whose readiness probe is the
protocol's ``GET /health``).
"""

from __future__ import annotations

from typing import Any, Callable

from broker.errors import BAD_TASK, EpisodeError
from broker.keys import env_instance_id
from broker.records import EpisodeSpec
from broker.settings import Settings
from broker.states import EnvProtocol
from workers.budget import Budget
from workers.env_mappings import Mapping

READINESS = {EnvProtocol.OPENENV: "/health", EnvProtocol.ORS: "/health"}


def protocol_env_port(spec: EpisodeSpec, instance: tuple[int, str], *, settings: Settings, client: Any,
                      budget: Budget, guard: Any, breakers: Any, check: Callable[[], None]) -> Any:
    """The env port of ``spec`` on a server of its protocol; ``instance`` is (number,
    attempt_id) of the attempt that began the trajectory, as for the original protocol."""
    breaker = breakers.for_env(spec.base_url, readiness=READINESS.get(spec.protocol, "/envs"))
    if spec.protocol == EnvProtocol.OPENENV:
        from workers.openenv_port import OpenEnvPort  # the WebSocket client only where it is used

        return OpenEnvPort(spec, settings, budget, guard, breaker, check, client, Mapping.load(spec.mapping))
    if spec.protocol == EnvProtocol.ORS:
        from workers.ors_port import OrsPort

        return OrsPort(spec, env_instance_id(spec.episode_id, *instance), settings, budget, guard, breaker, check,
                       client)
    raise EpisodeError(BAD_TASK, f"protocol {spec.protocol!r} is not one this worker speaks "
                                 f"({', '.join(p for p in EnvProtocol if p)})", transient=False)
