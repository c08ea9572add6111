"""The folders a request may make the producer read: task files and datasets named over HTTP.

``interactor feed serve`` plans a job from ``POST /start_rollout``'s body, whose task files and
datasets are paths on the server's disk. Without a bound, anyone who can reach the feed server
could have it open any file the process can read (``/etc/passwd`` as a dataset, a private key as a
task file) and learn from the error text or the records what it holds. Paths an operator types on
the command line are not bounded: they already hold the process's rights.

One rule decides: the path is made absolute, ``~`` expanded and every symlink and ``..`` resolved
(``os.path.realpath``), and the file is opened by that resolved path, which must lie inside a root.
Checking the resolved path and then opening the one checked means a symlink planted inside a root
cannot point outside it, and no spelling of the path (``a/../../etc``, ``//``, ``~``) walks around
the check.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable


class OutsideRoots(ValueError):
    """A path that resolves outside every allowed folder; the message names it and the folders."""


@dataclass(frozen=True)
class ReadRoots:
    """Folders (resolved, absolute) under which files may be read."""

    roots: tuple[str, ...]

    @classmethod
    def of(cls, folders: Iterable[str | os.PathLike]) -> "ReadRoots":
        roots = tuple(dict.fromkeys(os.path.realpath(os.path.expanduser(os.fspath(f))) for f in folders))
        if not roots:
            raise ValueError("no folders given: a request could read nothing")
        return cls(roots)

    @classmethod
    def from_setting(cls, value: str, *, default: str | os.PathLike, also: Iterable[str | os.PathLike] = ()) -> "ReadRoots":
        """``value`` is a comma-separated list of folders ("" = ``default``); ``also`` are added
        (the folder where the server writes inline task files of its own)."""
        named = [v.strip() for v in value.split(",") if v.strip()] or [os.fspath(default)]
        return cls.of([*named, *also])

    def resolve(self, path: str | os.PathLike, what: str) -> str:
        """The resolved path to open; :class:`OutsideRoots` when it lies outside every root."""
        real = os.path.realpath(os.path.expanduser(os.fspath(path)))
        if any(Path(real).is_relative_to(root) for root in self.roots):
            return real
        raise OutsideRoots(f"{what} {os.fspath(path)!r} is outside the folders this server may read "
                           f"({', '.join(self.roots)}; the operator sets them with INTERACTOR_FEED_TASK_ROOTS)")
