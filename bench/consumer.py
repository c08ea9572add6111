"""``interactor consumer`` exactly as shipped, plus a record-latency observer.

``python -m bench.consumer OUT [consumer flags]`` (settings from ``INTERACTOR_*``) runs the
real consumer command; the only addition is one more observer on its Ingestor, which notes for
every step record when the step happened (``StepRecord.created_at``, set by the worker) and
when its batch was committed and acknowledged (now). When the consumer stops (SIGTERM) the
pairs are written to ``OUT`` as float64 (created_at, committed_at) pairs.
"""

from __future__ import annotations

import os
import sys
import time
from array import array

from broker.records import StepRecord


class LatencyObserver:
    def __init__(self) -> None:
        self.pairs = array("d")

    def __call__(self, records) -> None:
        now = time.time()
        pairs = self.pairs
        for r in records:
            if type(r) is StepRecord:
                pairs.append(r.created_at)
                pairs.append(now)

    def dump(self, path: str) -> None:
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            self.pairs.tofile(f)
        os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out, rest = argv[0], argv[1:]
    observer = LatencyObserver()

    import consumer.ingest as ingest

    original = ingest.Ingestor.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.observers.append(observer)

    ingest.Ingestor.__init__ = init
    from interactor.cli import main as cli_main

    try:
        return cli_main(["consumer", "--name", "bench-consumer", *rest])
    finally:
        observer.dump(out)


if __name__ == "__main__":
    sys.exit(main())
