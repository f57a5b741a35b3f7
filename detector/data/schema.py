"""The record types of COCO instances JSON and PASCAL VOC XML, declared once, and the
readers that check every file against them field by field (``msgspec``; the VOC XML
reader, ``read_voc_xml``, is in ``voc_xml.py``).

The rules, the same for both formats:

- strict types: a bool is not a number, a string is not an integer (JSON); a VOC text
  field must spell a number;
- numbers are finite (``|x| <= 1e300``; JSON has no NaN or Infinity, and ``1e309``
  overflows), ids fit int64, image sizes are positive and at most ``MAX_SIDE`` px;
- flags (``iscrowd``, ``ignore``, ``difficult``, VOC ``<difficult>`` / ``<truncated>``)
  are 0 or 1: ``"0"``, ``true`` or VOC's ``false`` are refused rather than guessed at;
- nesting is bounded by the decoder (Python's recursion limit, about 1000 levels; COCO
  needs 4): deeper input is one "nested too deep" error, never a ``RecursionError``.

Fields the project does not read (``segmentation``, ``info``, ``license``, VOC
``<pose>``...) are not declared and not checked beyond the nesting bound.

Every message names the file and the path of the field, e.g.
``annotation file a.json: annotations[3].bbox[0]: expected a number, got true``.

Speed: the whole COCO file is decoded into the typed records in one pass; only when
that fails is it decoded again entry by entry, so that every bad entry is reported with
its index and the good ones are kept. Measured on a generated COCO-train-sized file
(118,287 images, 860,001 annotations, 174 MB; 2 shared CPU cores at load 8-10, so
noisy; memory above the imports): ``json.loads`` 16.5 s / 1082 MiB, :func:`read_coco`
6.0 s / 529 MiB, the whole ``parse_coco`` 29 s / 581 MiB (before the schema: 67 s /
1247 MiB, the same load); with one bad entry, :func:`read_coco` 12.8 s.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Callable, List, Literal, Optional, Tuple, Union

import msgspec

from .files import DataError, read_json_bytes

MAX_NUMBER = 1e300  # finite numbers only (1e309 reads as infinity)
MAX_SIDE = 2**31 - 1  # image width / height, pixels

Int64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
Number = Annotated[float, msgspec.Meta(ge=-MAX_NUMBER, le=MAX_NUMBER)]  # an int or a float, finite
Side = Annotated[float, msgspec.Meta(gt=0, le=MAX_SIDE)]
Flag = Literal[0, 1]
FLAG_FIELDS = ("iscrowd", "ignore", "difficult", "truncated")

OnError = Callable[[str], None]  # receives one message per bad entry (``Issues.error``)


class CocoImage(msgspec.Struct, gc=False):
    """An entry of ``images``."""

    id: Int64
    file_name: str
    width: Side
    height: Side


class CocoCategory(msgspec.Struct, gc=False):
    """An entry of ``categories`` (``name`` defaults to the id)."""

    id: Int64
    name: Optional[str] = None


class CocoAnnotation(msgspec.Struct, gc=False):
    """An entry of ``annotations``: ``bbox`` is ``[x, y, w, h]`` in pixels; ``area``
    (pixels^2) may be left out or null."""

    id: Int64
    image_id: Int64
    category_id: Int64
    bbox: Annotated[List[Number], msgspec.Meta(min_length=4, max_length=4)]
    area: Optional[Number] = None
    iscrowd: Flag = 0
    ignore: Flag = 0
    difficult: Flag = 0


class CocoFile(msgspec.Struct):
    """A COCO instances file (``annotations`` may be left out, not null)."""

    images: List[CocoImage]
    categories: List[CocoCategory]
    annotations: List[CocoAnnotation] = []


class CocoGroundTruthImage(msgspec.Struct, gc=False):
    """An ``images`` entry of a ground-truth file that detections are scored against
    (``tools/eval.py --annotations``): only ``id`` is needed; the other fields are
    checked when present."""

    id: Int64
    file_name: Optional[str] = None
    width: Optional[Side] = None
    height: Optional[Side] = None


class CocoGroundTruth(msgspec.Struct):
    """A ground-truth file to score against: :class:`CocoFile` with
    :class:`CocoGroundTruthImage` entries."""

    images: List[CocoGroundTruthImage]
    categories: List[CocoCategory]
    annotations: List[CocoAnnotation] = []


class _CocoSections(msgspec.Struct):
    """The top level only: each entry kept undecoded, to be checked one by one."""

    images: List[msgspec.Raw]
    categories: List[msgspec.Raw]
    annotations: List[msgspec.Raw] = []


class _CocoSectionsParsed(msgspec.Struct):
    """The same, for a file already parsed by ``json`` (entries as Python values)."""

    images: List[Any]
    categories: List[Any]
    annotations: List[Any] = []


# The entry type of each section, per file type.
COCO_SECTIONS = {
    CocoFile: (("images", CocoImage), ("categories", CocoCategory), ("annotations", CocoAnnotation)),
    CocoGroundTruth: (("images", CocoGroundTruthImage), ("categories", CocoCategory), ("annotations", CocoAnnotation)),
}


class VocSize(msgspec.Struct):
    width: Annotated[int, msgspec.Meta(gt=0, le=MAX_SIDE)]
    height: Annotated[int, msgspec.Meta(gt=0, le=MAX_SIDE)]


class VocBox(msgspec.Struct):
    """``<bndbox>``: VOC's 1-based inclusive pixel indices (fractions accepted)."""

    xmin: Number
    ymin: Number
    xmax: Number
    ymax: Number


class VocObject(msgspec.Struct):
    """An ``<object>``; an empty ``<difficult/>`` or ``<truncated/>`` is 0."""

    name: str
    bndbox: VocBox
    difficult: Flag = 0
    truncated: Flag = 0


class VocFile(msgspec.Struct):
    """One ``Annotations/<id>.xml``. ``objects[j]`` is None when object ``j`` was bad
    (reported), so indices and counts stay those of the file."""

    size: VocSize
    objects: List[Optional[VocObject]] = []


# ---------------------------------------------------------------------------- messages

_TYPE_WORDS = {"int": "an integer", "float": "a number", "str": "a string", "array": "a list",
               "object": "an object", "bool": "a boolean", "null": "null"}
_PATH_TOKEN = re.compile(r"\.([^.\[]+)|\[(\d+)\]")


class _NonFinite:
    """Stands for a NaN / Infinity constant of a file Python's ``json`` writes."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _show(value: Any, limit: int = 60) -> str:
    """``value`` as JSON-like text (``true``, ``"abc"``, ``[1, 2]``), shortened."""
    if isinstance(value, _NonFinite):
        return value.text
    try:
        text = json.dumps(value, default=repr)
    except (ValueError, TypeError, RecursionError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _value_at(entry: Any, steps: List[Union[str, int]]) -> Any:
    """The value at ``steps`` inside ``entry`` (a decoded JSON value or a ``msgspec.Raw``)."""
    try:
        value = msgspec.json.decode(entry) if isinstance(entry, msgspec.Raw) else entry
        for step in steps:
            value = value[step]
        return value
    except (msgspec.MsgspecError, LookupError, TypeError, RecursionError):
        return ...


def _reason(error: str, steps: List[Union[str, int]], entry: Any) -> str:
    """msgspec's validation message rewritten in the project's words, with the value."""
    value = _value_at(entry, steps)
    got = f", got {_show(value)}" if value is not ... else ""
    key = steps[-1] if steps else ""
    if isinstance(value, _NonFinite) and re.match(r"Expected `(float|int)", error):
        return f"expected a finite number{got}"
    if key in FLAG_FIELDS and (error.startswith("Expected `int`") or error.startswith("Invalid enum")):
        return f"expected 0 or 1{got}"
    if key == "bbox" and "of length" in error:
        return f"expected 4 numbers [x, y, w, h]{got}"
    m = re.match(r"Object missing required field `(\w+)`", error)
    if m:
        return f"has no '{m.group(1)}'"
    m = re.match(r"Expected `([\w |]+)`, got `(\w+)`", error)
    if m:
        kinds = " or ".join(_TYPE_WORDS.get(k, k) for k in m.group(1).split(" | "))
        return f"expected {kinds}{got or ', got ' + _TYPE_WORDS.get(m.group(2), m.group(2))}"
    m = re.match(r"Expected `(\w+)` ([<>]=?) (\S+)", error)
    if m and m.group(1) == "float" and m.group(3) in (f"{MAX_NUMBER:g}", f"{-MAX_NUMBER:g}"):
        return f"expected a finite number{got}"
    if m and m.group(1) == "int" and m.group(3) in (str(2**63 - 1), str(-(2**63))):
        return f"expected an integer that fits int64{got}"
    if m and m.group(2) + m.group(3) in (">0.0", ">0", ">=1"):
        return f"expected a positive {'integer' if m.group(1) == 'int' else 'number'}{got}"
    if m:
        return f"expected {_TYPE_WORDS.get(m.group(1), m.group(1))} {m.group(2)} {m.group(3)}{got}"
    if error.startswith("Number out of range"):
        return "number out of range: numbers must be finite (|x| <= 1e300) and ids fit int64"
    return error[:1].lower() + error[1:] + got


def describe(where: str, exc: msgspec.ValidationError, entry: Any) -> str:
    """``<where><path>: <reason>`` for a validation error of ``entry`` (at ``where``)."""
    text = str(exc)
    error, _, path = text.partition(" - at `$")
    path = path.rstrip("`")
    steps: List[Union[str, int]] = [a if a else int(b) for a, b in _PATH_TOKEN.findall(path)]
    reason = _reason(error, steps, entry)
    full = (where + path) if where else path.lstrip(".")
    if reason.startswith("has no ") and not full:
        return f"missing the {reason[len('has no '):]} section"
    if reason.startswith("has no "):
        return f"{full} {reason}"
    return f"{full or 'the top level'}: {reason}"


# ---------------------------------------------------------------------------- COCO JSON


def _line_col(raw: bytes, offset: int) -> Tuple[int, int]:
    line = raw.count(b"\n", 0, offset) + 1
    return line, offset - (raw.rfind(b"\n", 0, offset) + 1) + 1


_NON_FINITE = re.compile(rb"-?(Infinity|NaN)")


def _sections(raw: bytes, path: str) -> Tuple[Any, bool]:
    """The top level as ``_CocoSections`` (entries undecoded), and whether the entries
    are ``msgspec.Raw`` (else Python values: a file with NaN / Infinity constants,
    re-read with ``json`` so that those values can be named by path).

    Raises:
        DataError: not JSON, nested too deep, or a bad top level (named).
    """
    where = f"annotation file {path}"
    try:
        return msgspec.json.decode(raw, type=_CocoSections, strict=True), True
    except msgspec.ValidationError as exc:
        entry = _value_at(msgspec.Raw(raw), [])
        raise DataError(f"{where}: {describe('', exc, entry)}") from None
    except RecursionError:
        raise DataError(f"{where}: nested too deep (more than about 1000 levels of lists and objects)") from None
    except msgspec.DecodeError as exc:
        m = re.search(r"\(byte (\d+)\)", str(exc))
        offset = int(m.group(1)) if m else 0
        line, col = _line_col(raw, offset)
        reason = str(exc).split(" (byte")[0].replace("JSON is malformed: ", "")
        if not _NON_FINITE.match(raw, offset):
            raise DataError(f"{where} is not valid JSON: {reason} at line {line} column {col}") from None
    try:
        data = json.loads(raw, parse_constant=_NonFinite)
    except (ValueError, RecursionError):
        raise DataError(f"{where} is not valid JSON: NaN / Infinity are not JSON numbers "
                        f"(line {line} column {col})") from None
    try:
        return msgspec.convert(data, type=_CocoSectionsParsed, strict=True), False
    except msgspec.ValidationError as exc:
        raise DataError(f"{where}: {describe('', exc, data)}") from None


def _coco_entries(raw: bytes, path: str, on_error: OnError, file_type: type) -> Any:
    """Every section checked entry by entry: each bad entry is reported through
    ``on_error`` with its index and field, and left out."""
    sections, is_raw = _sections(raw, path)
    good = {}
    for name, kind in COCO_SECTIONS[file_type]:
        kept = []
        for i, entry in enumerate(getattr(sections, name)):
            try:
                if is_raw:
                    kept.append(msgspec.json.decode(entry, type=kind, strict=True))
                else:
                    kept.append(msgspec.convert(entry, type=kind, strict=True))
            except msgspec.ValidationError as exc:
                on_error(f"annotation file {path}: {describe(f'{name}[{i}]', exc, entry)}")
            except RecursionError:
                on_error(f"annotation file {path}: {name}[{i}] is nested too deep")
        good[name] = kept
    return file_type(**good)


def read_coco(path: str, on_error: OnError, file_type: type = CocoFile) -> Any:
    """Read and check a COCO instances file against the declared types (``file_type``:
    :class:`CocoFile`, or :class:`CocoGroundTruth` for a file to score against).

    Returns the good entries of each section, in file order; each bad entry is reported
    through ``on_error`` (one message naming the file, the index and the field) and left
    out.

    Raises:
        FileNotFoundError: no such file.
        DataError: unreadable, not JSON, nested too deep, or a bad top level (a missing
            ``images`` / ``categories``, ``"annotations": null``).
    """
    return _typed_coco(read_json_bytes(path, "annotation file"), path, on_error, file_type)


def _typed_coco(raw: bytes, path: str, on_error: OnError, file_type: type) -> Any:
    """:func:`read_coco` on the file's bytes ``raw`` (``path`` names it in messages)."""
    try:
        return msgspec.json.decode(raw, type=file_type, strict=True)
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
        pass  # find and name every bad entry
    return _coco_entries(raw, path, on_error, file_type)


def raise_error(message: str) -> None:
    """An ``OnError`` that stops at the first bad entry."""
    raise DataError(message)


def load_coco_json(path: str, file_type: type = CocoFile) -> dict:
    """A COCO instances file as plain JSON data (every key kept, e.g. to write it back or
    hand it to pycocotools), after checking it against the declared ``file_type``.

    Raises:
        FileNotFoundError, DataError: as :func:`read_coco`, and at the first bad entry.
    """
    path = str(path)
    raw = read_json_bytes(path, "annotation file")  # read once: checked, then decoded untyped
    _typed_coco(raw, path, raise_error, file_type)
    try:
        return msgspec.json.decode(raw)
    except msgspec.DecodeError:  # a NaN in a field the project does not read
        return json.loads(raw)
