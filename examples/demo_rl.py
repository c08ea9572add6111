"""``make demo-rl``: online RL on one machine, no GPU. Starts the bundled env server and the
model stand-in (its skill rising with each weight version pushed to it), ``interactor feed
serve examples/tasks.yaml`` (an embedded Redis, local workers and consumer, a continuous job),
and runs the small trainer loop of ``examples/rl_trainer.py`` against it: rewards rise in its
lines and in the results browser (``interactor ui --store <run-dir>/results.sqlite``).

Every process it starts stops with it (SIGTERM to the feed server, which stops its own fleet).
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
from pathlib import Path

from examples import rl_trainer
from interactor.children import spawn, terminate

FOLDER = Path(__file__).resolve().parent


def start_server(module: str, *args: str) -> tuple[subprocess.Popen, str]:
    p = spawn([sys.executable, "-m", module, "--port", "0", *args], stdout=subprocess.PIPE,
              stderr=subprocess.DEVNULL, text=True)
    line = p.stdout.readline()
    if "listening on" not in line:
        terminate([p], 5)
        raise RuntimeError(f"{module} did not start: {line!r}")
    return p, line.split("listening on", 1)[1].strip()


def feed_url_from_log(proc: subprocess.Popen, log: Path, timeout_s: float = 120.0) -> str:
    """The URL ``interactor feed serve`` prints once it listens (its log at ``log``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace") if log.exists() else ""
        for line in text.splitlines():
            if line.startswith("feed of job ") and " at http" in line:
                return line.rsplit(" at ", 1)[1].strip()
        if proc.poll() is not None:
            raise RuntimeError(f"interactor feed serve exited with {proc.returncode}:\n{text[-3000:]}")
        time.sleep(0.2)
    raise RuntimeError(f"interactor feed serve did not start within {timeout_s:.0f}s (see {log})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m examples.demo_rl", description=__doc__.split("\n\n")[0])
    p.add_argument("--run-dir", default="runs/demo-rl")
    p.add_argument("--steps", type=int, default=12, help="training steps")
    p.add_argument("--batch", type=int, default=4, help="groups per step")
    p.add_argument("--workers", type=int, default=None, help="local worker processes (default: one per core)")
    p.add_argument("--max-staleness", type=int, default=2)
    args = p.parse_args(argv)
    run_dir = Path(args.run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen] = []
    feed_proc = None
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        env_proc, env_url = start_server("examples.envserver")
        procs.append(env_proc)
        model_proc, model_url = start_server("examples.model_standin", "--latency-ms", "20", "--skill", "0.2",
                                        "--skill-per-version", "0.07", "--weight-version", "v0")
        procs.append(model_proc)
        print(f"env server at {env_url}, model stand-in at {model_url}/v1 (a stand-in, not a model: "
              "its skill rises with each weight version pushed to it)", flush=True)
        log = run_dir / "feed-serve.log"
        cmd = [sys.executable, "-m", "interactor.cli", "feed", "serve", str(FOLDER / "tasks.yaml"),
               "--env-base-url", env_url, "--llm-base-url", model_url + "/v1", "--model", "stand-in",
               "--run-dir", str(run_dir), "--port", "0", "--max-ahead", str(2 * args.batch),
               "--max-staleness", str(args.max_staleness)]
        if args.workers:
            cmd += ["--workers", str(args.workers)]
        feed_proc = spawn(cmd, log_path=log)
        feed_url = feed_url_from_log(feed_proc, log)
        print(f"feed at {feed_url} (log: {log})", flush=True)
        out = rl_trainer.train(feed_url, model_root=model_url, steps=args.steps, batch=args.batch,
                               say=lambda line: print(line, flush=True))
        print()
        for line in rl_trainer.summary_lines(out):
            print(line)
        print(f"browse the results: interactor ui --store {run_dir / 'results.sqlite'}")
        return 0 if out["rewards"] else 1
    except KeyboardInterrupt:
        print("\ninterrupted: stopping", flush=True)
        return 130
    finally:
        if feed_proc is not None:
            terminate([feed_proc], 60)  # it stops its workers, consumer and Redis first
        terminate(procs, 5)


if __name__ == "__main__":
    sys.exit(main())
