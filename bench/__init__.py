"""The benchmark harness: ``make bench`` / ``python -m bench`` / ``interactor bench`` (see docs/benchmarks.md)."""
