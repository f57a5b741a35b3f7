"""A strict YAML reader for config files and ``key=value`` overrides.

PyYAML's ``SafeLoader`` builds whatever a file describes: an alias bomb (a few hundred
bytes whose aliases expand to billions of nodes) hangs the process, a document nested
thousands deep ends in ``RecursionError``, and a key written twice silently keeps the
last value. ``StrictLoader`` checks the composed node graph before any Python object is
built, so every such file is one ``YAMLRefused`` line:

- nesting deeper than ``MAX_DEPTH`` levels is refused while composing (before Python's
  recursion limit is reached);
- the size of the document with every alias expanded (what OmegaConf would copy) is
  counted on the node graph, each shared node once, and refused above ``MAX_NODES``;
  anchors and aliases of normal size are accepted;
- a mapping key given twice is refused, naming the key and both lines.

Dates and times (``2024-01-01``) are read as the strings they are written as.
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

import yaml

# A config is a handful of sections a few levels deep; a list of rules adds two levels.
MAX_DEPTH = 64
# Expanded nodes (scalars, lists, mappings) in one document; the largest config is ~300.
MAX_NODES = 100_000
_IN_PROGRESS = (-1, -1)


class YAMLRefused(ValueError):
    """A YAML document refused by ``StrictLoader`` (one line, without the file name)."""


class StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` with the bounds of the module docstring."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:  # noqa: D102 - PyYAML's hook
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise YAMLRefused(f"nested more than {MAX_DEPTH} levels deep (line {mark.line + 1})")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_document(self, node: Any) -> Any:  # noqa: D102 - PyYAML's hook
        memo: Dict[int, Tuple[int, int]] = {}
        size = expanded_size(node, memo) if node is not None else 0
        if len(memo) > MAX_NODES:  # as written, no alias needed
            raise YAMLRefused(f"holds more than {MAX_NODES} values (a config holds a few hundred): is it a data "
                              "file? Configs name data files (data.train.ann_file) rather than hold their contents")
        if size > MAX_NODES:
            raise YAMLRefused(f"expands to more than {MAX_NODES} values once its aliases are "
                              f"resolved (an alias bomb?); write the values out instead")
        return super().construct_document(node)

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:  # noqa: D102 - PyYAML's hook
        seen: Dict[Any, int] = {}
        for key_node, _ in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            if key is None or key == "<<":
                continue
            line = key_node.start_mark.line + 1
            if key in seen:
                raise YAMLRefused(f"key '{key}' is given twice (lines {seen[key]} and {line}); "
                                  "YAML would keep the last silently")
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


# No config key takes a date: an unquoted 2024-01-01 (a run folder's name) stays a string.
StrictLoader.add_constructor("tag:yaml.org,2002:timestamp", yaml.SafeLoader.construct_scalar)


def expanded_size(node: Any, memo: Dict[int, Tuple[int, int]], depth: int = 1) -> int:
    """Nodes in ``node`` with every alias expanded. ``memo`` maps a node's id to its
    ``(size, height)``, so each shared node is walked once however large the result;
    an alias that contains itself, or aliases nested past ``MAX_DEPTH``, are refused."""
    return _size_and_height(node, memo, depth)[0]


def _size_and_height(node: Any, memo: Dict[int, Tuple[int, int]], depth: int) -> Tuple[int, int]:
    known = memo.get(id(node))
    if known == _IN_PROGRESS:
        raise YAMLRefused(f"an alias contains itself (line {node.start_mark.line + 1})")
    if known is None:
        memo[id(node)] = _IN_PROGRESS
        size, height = 1, 1
        if isinstance(node, (yaml.SequenceNode, yaml.MappingNode)):
            children = node.value if isinstance(node, yaml.SequenceNode) else [n for kv in node.value for n in kv]
            for child in children:
                if depth >= MAX_DEPTH:
                    break
                child_size, child_height = _size_and_height(child, memo, depth + 1)
                size, height = size + child_size, max(height, 1 + child_height)
        known = memo[id(node)] = (size, height)
    if depth - 1 + known[1] > MAX_DEPTH:
        raise YAMLRefused(f"nested more than {MAX_DEPTH} levels deep once its aliases are resolved "
                          f"(line {node.start_mark.line + 1})")
    return known


def load_yaml(text: str) -> Any:
    """Parse one YAML document with ``StrictLoader``.

    Raises:
        YAMLRefused: a bound of the module docstring.
        yaml.YAMLError: not valid YAML.
    """
    return yaml.load(text, Loader=StrictLoader)  # noqa: S506 - a SafeLoader subclass
