"""What the model gateway (workers/gateway.py) costs per proxied call: the CPU of the gateway's
process per call, and the caller's CPU per call through the gateway against a direct call to the
same model stand-in (``python -m bench.gateway_cost``; docs/benchmarks.md).

Three processes, so that each one's CPU is its own: the model stand-in, the gateway (one session,
its calls forwarded through the worker's model client and each recorded and packed as a step
record, as an agent episode's are, the publish to Redis left out: the step loop pays it too),
and the caller (the worker's model client, the same for both ways). Calls are sequential: the
figure is CPU per call, not throughput.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from bench.cluster import ROOT


def serve(model_url: str) -> int:
    """The gateway's process: one open session, its URL and key on stdout, until stdin closes."""
    from broker.settings import Settings
    from workers.agent_episode import CallRecorder
    from workers.gateway import AgentSession, Gateway
    from workers.loop import LoopConfig
    from workers.modelclient import ModelClient

    client = ModelClient(Settings.from_env({}, llm_retries=0))

    class Port:
        def complete(self, messages, **request):
            return client.complete(model_url, messages, model="stand-in", temperature=0.0, params=request,
                                   deadline=time.monotonic() + 30)

    recorder = CallRecorder(LoopConfig(job_id="bench", episode_id="bench.1.1.1.1", env_name="bench",
                                       group_id="bench.1.1.1", llm_model="stand-in"), lambda record: record.pack())
    gateway = Gateway("127.0.0.1", 0)
    gateway.serve_in_thread("bench-gateway")
    session = gateway.table.open(AgentSession("bench.1.1.1.1", "stand-in", Port(), recorder.record))
    print(json.dumps({"url": gateway.session_url(session), "key": session.key}), flush=True)
    sys.stdin.read()
    return 0


def _start(args: list[str]) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, *args], cwd=str(ROOT), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    return proc, proc.stdout.readline().strip()


def run_gateway_cost(calls: int = 2000) -> dict:
    import psutil

    from broker.settings import Settings
    from workers.modelclient import ModelClient

    model, line = _start(["-m", "examples.model_standin", "--port", "0"])
    model_url = line.rsplit(" ", 1)[-1] + "/v1"
    gateway, line = _start(["-m", "bench.gateway_cost", "--serve", model_url])
    session = json.loads(line)
    client = ModelClient(Settings.from_env({}, llm_retries=0))
    messages = [{"role": "user", "content": "What is 17 + 25?"}]

    def burst(url: str, key: str) -> tuple[float, float, float]:
        for _ in range(50):  # warm: connections, imports, caches
            client.complete(url, messages, model="stand-in", temperature=0.0, deadline=time.monotonic() + 30,
                            api_key=key)
        g0 = psutil.Process(gateway.pid).cpu_times()
        c0, w0 = time.process_time(), time.perf_counter()
        for _ in range(calls):
            client.complete(url, messages, model="stand-in", temperature=0.0, deadline=time.monotonic() + 30,
                            api_key=key)
        c1, w1 = time.process_time(), time.perf_counter()
        g1 = psutil.Process(gateway.pid).cpu_times()
        gateway_s = (g1.user + g1.system) - (g0.user + g0.system)
        return (c1 - c0) / calls * 1000, gateway_s / calls * 1000, (w1 - w0) / calls * 1000

    try:
        direct_caller_ms, _, direct_wall_ms = burst(model_url, "")
        proxied_caller_ms, gateway_ms, proxied_wall_ms = burst(session["url"], session["key"])
    finally:
        for proc in (gateway, model):
            proc.stdin.close()
            proc.terminate()
            proc.wait(10)
    return {"calls": calls, "gateway_cpu_ms_per_call": round(gateway_ms, 3),
            "caller_cpu_ms_per_call_direct": round(direct_caller_ms, 3),
            "caller_cpu_ms_per_call_proxied": round(proxied_caller_ms, 3),
            "wall_ms_per_call_direct": round(direct_wall_ms, 3), "wall_ms_per_call_proxied": round(proxied_wall_ms, 3)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gateway_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--serve", metavar="MODEL_URL", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        return serve(args.serve)
    print(json.dumps(run_gateway_cost(args.calls)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
