"""The README's "evaluate your own model" block, its three lines as written, against a real
model server: llama.cpp's ``llama-server`` serving SmolLM2-135M-Instruct (``make
test-real-model`` installs both), the README's ``interactor serve-env`` line, its task file and
its ``interactor run`` line (issue 48).

What differs from the README, and why: the ports are free ones (8000 and 8080 may be taken), the
binary and the GGUF file are the installed ones (the README names them ``llama-server`` and
``your-model.gguf``), and the server gets ``--no-repack --threads 2``, this machine's needs
(tests/test_real_model.py and examples/learn/llama.py say why). Skipped, with the reason, when
the server or the model is not installed.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest

from examples.learn.llama import server_binary, smollm2_gguf
from tests.conftest import ROOT, wait_for
from tests.test_docs import blocks, free_port, readme_block

pytestmark = [pytest.mark.real_model, pytest.mark.integration]


def readme_commands() -> list[str]:
    """The README block that starts the model server, the env server and the run, one line each
    (comments cut)."""
    (block,) = [t for n, _, t in blocks() if n == "README.md" and "llama-server" in t and "serve-env" in t]
    return [line.split(" #", 1)[0].strip() for line in block.splitlines() if line.strip()]


def test_the_readmes_evaluate_your_own_model_block_runs_against_llama_server(tmp_path):
    binary, model = server_binary(), smollm2_gguf()
    if not binary or not os.path.exists(binary) or not model:
        pytest.skip("llama-server or SmolLM2 is not installed: make test-real-model installs them")
    lines = readme_commands()
    llama_line = next(line for line in lines if line.startswith("llama-server "))
    serve_line = next(line for line in lines if line.startswith("interactor serve-env "))
    run_line = next(line for line in lines if line.startswith("interactor run "))
    model_port, env_port = str(free_port()), str(free_port())

    llama = shlex.split(llama_line)
    gguf = llama[llama.index("-m") + 1]
    readme_model_port = llama[llama.index("--port") + 1]
    llama = [binary] + [model if w == gguf else model_port if w == readme_model_port else w for w in llama[1:]]
    llama += ["--host", "127.0.0.1", "--no-repack", "--threads", "2"]
    served = shlex.split(serve_line)[1:]
    readme_env_port = served[served.index("--port") + 1]
    served = [env_port if w == readme_env_port else w for w in served]
    argv = [w.replace(f":{readme_model_port}/", f":{model_port}/") for w in shlex.split(run_line)[1:]]
    assert any(f":{model_port}/v1" in w for w in argv), (run_line, argv)

    checkout = tmp_path / "checkout"  # the README's paths are the checkout's
    checkout.mkdir()
    (checkout / "examples").symlink_to(ROOT / "examples")
    task_file = readme_block("yaml", "dataset: examples/data/arithmetic.jsonl")
    (checkout / "tasks.yaml").write_text(task_file.replace(f":{readme_env_port}", f":{env_port}"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("INTERACTOR_") and k != "REDIS_URL"}
    env["PYTHONPATH"] = str(ROOT)
    log = open(tmp_path / "llama-server.log", "wb")
    server = subprocess.Popen(llama, stdout=log, stderr=subprocess.STDOUT)
    envs = subprocess.Popen([sys.executable, "-m", "interactor.cli", *served], cwd=str(checkout), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        import requests

        def model_ready() -> bool:
            assert server.poll() is None, (tmp_path / "llama-server.log").read_text()[-3000:]
            try:
                return requests.get(f"http://127.0.0.1:{model_port}/v1/models", timeout=2).status_code == 200
            except requests.RequestException:
                return False

        wait_for(model_ready, 300, interval=0.5, what="llama-server to load the model")
        assert "listening on" in "".join(envs.stdout.readline() for _ in range(2))
        out = subprocess.run([sys.executable, "-m", "interactor.cli", *argv], cwd=str(checkout), env=env,
                             capture_output=True, text=True, timeout=1200)
    finally:
        for p in (envs, server):
            p.terminate()
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        log.close()
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "preflight:" in out.stdout and "scores (completed episodes" in out.stdout
    job = re.search(r"^job (\S+): (\d+) episodes", out.stdout, re.M)
    listed = subprocess.run([sys.executable, "-m", "interactor.cli", "results", job.group(1), "--json"],
                            cwd=str(checkout), env=env, capture_output=True, text=True, timeout=60)
    import json

    res = json.loads(listed.stdout)
    assert res["job"]["completed"] == int(job.group(2)), res["job"]
    assert res["job"]["model"] == shlex.split(run_line)[shlex.split(run_line).index("--model") + 1]
