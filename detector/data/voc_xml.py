"""The PASCAL VOC XML reader: one annotation file against the types declared in
``schema.py`` (``VocSize``, ``VocObject``, ``VocFile``), with ``schema.py``'s rules and
messages. Besides those: an element that holds one value (``<size>``, an object's
``<name>``, ``<bndbox>``, ``<xmin>``...) given twice is refused with its path rather than
one of them kept silently; entity expansion is bounded by expat (a "billion laughs"
file is "not valid XML"), and external entities are never fetched.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path
from typing import List, Optional, Tuple

import msgspec

from .files import DataError, read_file_bytes, read_text_file
from .schema import OnError, VocFile, VocObject, VocSize, describe


class _RepeatedTag(ValueError):
    """A VOC element that holds one value given more than once (which would win is a guess)."""


def _single(node: ET.Element, tag: str, path: str) -> Optional[ET.Element]:
    """The one ``<tag>`` child of ``node`` (None if absent); ``_RepeatedTag`` naming
    ``path`` when there are several."""
    found = node.findall(tag)
    if len(found) > 1:
        raise _RepeatedTag(f"{path} has {len(found)} <{tag}> elements; one is expected")
    return found[0] if found else None


def _text(node: Optional[ET.Element], tag: str, path: str) -> Optional[str]:
    child = _single(node, tag, path) if node is not None else None
    text = child.text.strip() if child is not None and child.text is not None else ""
    return text or None


def _fields(node: Optional[ET.Element], tags: Tuple[str, ...], path: str) -> Optional[dict]:
    """The non-empty texts of ``tags`` under ``node`` (None when ``node`` is missing)."""
    if node is None:
        return None
    return {t: v for t in tags if (v := _text(node, t, path)) is not None}


def _voc_object(obj: ET.Element, path: str) -> dict:
    out = _fields(obj, ("name", "difficult", "truncated"), path)
    box = _fields(_single(obj, "bndbox", path), ("xmin", "ymin", "xmax", "ymax"), f"{path}.bndbox")
    if box is not None:
        out["bndbox"] = box
    return out


def _parse_xml(xml_path: Path) -> ET.Element:
    """The root element of ``xml_path``.

    Raises:
        FileNotFoundError: no such file.
        DataError: unreadable (a folder, no permission), an unknown encoding, not XML,
            or a root element other than ``<annotation>`` (namespaces are dropped: VOC's
            tags under an ``xmlns`` are read).
    """
    raw = read_file_bytes(xml_path, "VOC annotation file")
    try:
        root = ET.fromstring(raw)  # bytes: the XML declaration's encoding applies
    except ET.ParseError as exc:
        raise DataError(f"VOC annotation file {xml_path} is not valid XML: {exc}") from None
    except (LookupError, ValueError) as exc:  # encoding="klingon", a multi-byte encoding expat lacks
        raise DataError(f"VOC annotation file {xml_path} is not valid XML: {exc}") from None
    for element in root.iter():  # <annotation xmlns="..."> (some exporters): VOC's tags in a namespace
        if isinstance(element.tag, str) and element.tag.startswith("{"):
            element.tag = element.tag.split("}", 1)[1]
    if root.tag != "annotation":
        raise DataError(f"VOC annotation file {xml_path}: its root element is <{root.tag}>, not VOC's <annotation>")
    return root


def read_voc_xml(xml_path: Path, on_error: OnError) -> Optional[VocFile]:
    """Read and check one VOC annotation file against the declared types. Text fields
    are converted (``"500"`` -> 500), so ``<width>inf</width>`` or ``<difficult>false``
    are refused with the field's path.

    Returns the file (a bad object reported through ``on_error`` and None in
    ``objects``), or None after reporting a file-level problem: missing, unreadable,
    not XML, a bad or missing ``<size>``.
    """
    where = f"VOC annotation file {xml_path}"
    try:
        node = _parse_xml(xml_path)
    except (FileNotFoundError, DataError) as exc:
        on_error(str(exc))
        return None
    try:
        size_fields = _fields(_single(node, "size", "the annotation"), ("width", "height"), "size")
    except _RepeatedTag as exc:
        on_error(f"{where}: {exc}")
        return None
    if size_fields is None:
        on_error(f"{where} has no <size>")
        return None
    try:
        size = msgspec.convert(size_fields, type=VocSize, strict=False)
    except msgspec.ValidationError as exc:
        on_error(f"{where}: {describe('size', exc, size_fields)}")
        return None
    objects: List[Optional[VocObject]] = []
    for j, obj in enumerate(node.findall("object")):
        try:
            entry = _voc_object(obj, f"object[{j}]")
            objects.append(msgspec.convert(entry, type=VocObject, strict=False))
        except _RepeatedTag as exc:
            on_error(f"{where}: {exc}")
            objects.append(None)
        except msgspec.ValidationError as exc:
            on_error(f"{where}: {describe(f'object[{j}]', exc, entry)}")
            objects.append(None)
    return VocFile(size=size, objects=objects)


# The class lists of ImageSets/Main (``<class>_<split>.txt``) add a flag to each id.
_CLASS_LIST_FLAGS = ("-1", "0", "1")


def read_voc_split(split_file: Path) -> List[str]:
    """The image ids of a VOC image-set list (``ImageSets/Main/<split>.txt``), in file
    order, repeats kept: one id a line, or an id and a -1/0/1 flag (VOC's per-class
    lists). Blank lines are skipped.

    Raises:
        FileNotFoundError: no such file; DataError: no regular file, unreadable, or a
            line that is not an id (VOC ids hold no spaces: ``my photo 1`` is refused,
            not read as ``my``).
    """
    ids = []
    for n, line in enumerate(read_text_file(split_file, "VOC split file").splitlines(), 1):
        words = line.split()
        if len(words) == 2 and words[1] in _CLASS_LIST_FLAGS or len(words) == 1:
            ids.append(words[0])
        elif words:
            raise DataError(f"VOC split file {split_file} line {n}: {line.strip()!r} is not an image id (one id a "
                            "line, or an id and a -1/0/1 flag; VOC ids hold no spaces)")
    return ids
