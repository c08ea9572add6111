"""The harness's progress lines on stdout, one timestamped line per event of a run."""

from __future__ import annotations

import time


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)
