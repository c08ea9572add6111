"""``interactor gateway``: the model gateway's front for agents that run elsewhere
(workers/gateway_router.py; docs/deployment.md). Stateless: run any number behind one address."""

from __future__ import annotations

from broker.settings import REDIS

DEFAULT_GATEWAY_PORT = 8600


def register(sub, add) -> None:
    sp = add("gateway", cmd_gateway, "route agents that run elsewhere to the workers' model gateways (agent episodes)",
             reads=(REDIS,))
    sp.add_argument("--host", default="127.0.0.1",
                    help="address to listen on; 0.0.0.0 to serve agents on other hosts (default: %(default)s)")
    sp.add_argument("--port", type=int, default=DEFAULT_GATEWAY_PORT, help="0 picks a free one (default: %(default)s)")


def cmd_gateway(args) -> int:
    from interactor.common import redis_for, settings_from_args, with_local_redis
    from interactor.children import wait_for_signal
    from workers.gateway_router import GatewayRouter

    settings = with_local_redis(settings_from_args(args))
    router = GatewayRouter(settings, redis_for(settings), args.host, args.port)
    router.serve_in_thread("gateway-router")
    host, port = router.server_address[:2]
    print(f"model gateway on http://{host}:{port} (sessions routed through Redis)", flush=True)
    wait_for_signal()
    router.shutdown()
    return 0
