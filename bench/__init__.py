"""The benchmark harness: ``make bench`` / ``interactor bench`` (see docs/benchmarks.md)."""
