"""Reading one YAML document safely, for task files and YAML datasets, with its line marks.

Timestamps stay strings and a duplicated mapping key is an error (see :class:`_Loader`); the root
node is returned beside the data so that a task file's errors can name an entry's line.
"""

from __future__ import annotations

from typing import Any

import yaml

__all__ = ["load_yaml", "yaml_error"]

_YAMLBase = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _Loader(_YAMLBase):  # type: ignore[misc, valid-type]
    """Safe loader that keeps timestamps as strings and rejects duplicate mapping keys.

    ``2024-01-01`` would otherwise become a ``datetime.date``, which neither msgpack nor
    JSON can carry to a worker or an env; a duplicated key (``env_num`` twice) would
    otherwise silently keep the last value.
    """

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: set = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # "<<: *base" then overriding a key is legitimate
                key = self.construct_object(key_node, deep=True)
                try:
                    dup = key in seen
                except TypeError:
                    continue  # unhashable key: the base class reports it
                if dup:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping", node.start_mark,
                        f"found duplicate key {key!r}", key_node.start_mark)
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in _YAMLBase.yaml_implicit_resolvers.items()
}


def yaml_error(exc: yaml.YAMLError) -> str:
    """A YAML error in one line, with its line and column where the parser gave them."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    if mark is not None:
        return f"line {mark.line + 1} column {mark.column + 1}: {problem}"
    return str(exc).replace("\n", " ")


def load_yaml(path: str) -> tuple[Any, yaml.Node | None]:
    """Parse one YAML document; return (data, root node) so callers can report lines."""
    with open(path, "rb") as fh:
        loader = _Loader(fh)
        try:
            node = loader.get_single_node()
            data = loader.construct_document(node) if node is not None else None
        finally:
            loader.dispose()
    return data, node
