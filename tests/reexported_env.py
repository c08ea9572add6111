"""An env class reachable from this module but defined in another (tests/test_urls.py): a
worker whose allow-list admits ``tests.reexported_env:*`` must still refuse it."""

from envs.bundled import BundledEnv  # noqa: F401 - the re-export is the point
