"""Dataset readers: a task file entry's dataset file (.json, .jsonl, .yaml/.yml, .parquet) as rows.

Each reader returns a list of mappings, one task per row, or raises :class:`DatasetError` with
the row at fault; the task file's validation (``producer/taskfile.py``) adds the file, entry and
field to the message.
"""

from __future__ import annotations

import json
import re
from typing import Any

import yaml

from producer.plaindata import check_plain
from producer.yamlfile import load_yaml, yaml_error

__all__ = ["DatasetError", "DATASET_FORMATS", "READERS", "CHECKED_READERS", "rows_from_list", "parquet_row_refs"]

DATASET_FORMATS = (".json", ".jsonl", ".yaml", ".yml", ".parquet")
_LONG_DIGITS = re.compile(r"[0-9]{19}")  # an integer outside 64 bits has at least 19 digits


class DatasetError(Exception):
    """Raised inside dataset readers; the caller adds file/entry context."""

    def __init__(self, msg: str, row: int | None = None):
        super().__init__(msg)
        self.row = row


def rows_from_list(data: Any, what: str) -> list[dict]:
    """``data`` itself, if it is a list of mappings (``what`` names it in the error)."""
    if not isinstance(data, list):
        raise DatasetError(f"{what} must be a list of rows, got {type(data).__name__}")
    for i, row in enumerate(data, 1):
        if not isinstance(row, dict):
            raise DatasetError(f"row must be a mapping, got {type(row).__name__}", row=i)
    return data


def read_jsonl(path: str) -> list[dict]:
    rows: list[dict] = []
    loads = json.loads
    with open(path, "r", encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = loads(line)
            except ValueError as exc:  # JSONDecodeError
                raise DatasetError(f"line {lineno}: invalid JSON: {exc}", row=len(rows) + 1) from None
            if not isinstance(row, dict):
                raise DatasetError(f"line {lineno}: row must be a JSON object, got {type(row).__name__}",
                                   row=len(rows) + 1)
            if _LONG_DIGITS.search(line):  # rarely: only then is the row walked for a too-large integer
                bad = check_plain(row, "dataset")
                if bad:
                    raise DatasetError(f"line {lineno}: {bad}", row=len(rows) + 1)
            rows.append(row)
    return rows


def read_json(path: str) -> list[dict]:
    with open(path, "r", encoding="utf-8") as fh:
        text = fh.read()
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise DatasetError(f"invalid JSON: {exc}") from None
    rows = rows_from_list(data, "a .json dataset")
    if _LONG_DIGITS.search(text):
        for r, row in enumerate(rows, 1):
            bad = check_plain(row, "dataset")
            if bad:
                raise DatasetError(bad, row=r)
    return rows


def read_yaml(path: str) -> list[dict]:
    try:
        data, _ = load_yaml(path)
    except yaml.YAMLError as exc:
        raise DatasetError(f"not valid YAML: {yaml_error(exc)}") from None
    return rows_from_list(data, "a YAML dataset")


def read_parquet(path: str) -> list[dict]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid, OSError, ...
        raise DatasetError(f"cannot read Parquet: {type(exc).__name__}: {exc}") from None
    return table.to_pylist()


def parquet_row_refs(path: str) -> list[dict]:
    """One reference per row of a .parquet file, in the original system's shape, for an entry
    whose ``dataset_load_mode`` is ``parquet_row_ref``: the env gets ``{"__dataset_ref__": {"kind":
    "parquet_row", "path", "row_group", "row_in_group", "row_idx"}}`` and reads the row itself,
    so a large dataset is not copied into every episode spec. Only the file's footer is read."""
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(path).metadata
    except Exception as exc:  # pyarrow raises ArrowInvalid, OSError, ...
        raise DatasetError(f"cannot read Parquet: {type(exc).__name__}: {exc}") from None
    refs: list[dict] = []
    for group in range(meta.num_row_groups):
        for i in range(meta.row_group(group).num_rows):
            refs.append({"__dataset_ref__": {"kind": "parquet_row", "path": path, "row_group": group,
                                             "row_in_group": i, "row_idx": len(refs)}})
    return refs


READERS = {".json": read_json, ".jsonl": read_jsonl, ".yaml": read_yaml, ".yml": read_yaml,
           ".parquet": read_parquet}
# Rows decoded from JSON are plain data already (a too-large integer was looked for as they were
# read); the others' rows still need check_plain.
CHECKED_READERS = (read_json, read_jsonl)
