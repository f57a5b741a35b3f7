"""Reading the files of a data set: images (any bit depth to uint8 RGB) and file
names confined to a root folder. Every failure is one line naming the file.

``DataError`` is the data package's bad-input error (see ``dataset.py`` for the policy).
"""

from __future__ import annotations

import json
import os
import stat
from typing import List, NamedTuple, Optional

import numpy as np
from PIL import Image, ImageOps

from detector.files import missing_file_state, no_file_message
from detector.messages import DetectorError, first_line, shown_path


EXIF_ORIENTATION_TAG = 0x0112


class DataError(DetectorError, ValueError):
    """Bad input data (annotation file, image file, or a data set empty after filtering)."""



def read_json_bytes(path: str, what: str) -> bytes:
    """The JSON text of file ``path`` as UTF-8 bytes, as Python's ``json`` reads bytes: a
    UTF-8 byte-order mark (which Windows editors write) is dropped, and UTF-16 or UTF-32
    text (``json.detect_encoding``: by BOM or by the zero bytes of the first characters)
    is transcoded. ``what`` names the file in the messages ("annotation file").

    Raises:
        FileNotFoundError: no such file.
        DataError: unreadable, or not text in the detected encoding.
    """
    raw = read_file_bytes(path, what)
    encoding = json.detect_encoding(raw)
    return raw if encoding == "utf-8" else _decoded(raw, encoding, path, what).encode("utf-8")


def read_text_file(path: str | os.PathLike, what: str) -> str:
    """The text of file ``path`` (a list of ids, ...), in UTF-8 with or without a
    byte-order mark, UTF-16 or UTF-32, told apart as ``read_json_bytes`` does (a Windows
    editor's "Unicode" is UTF-16). Errors as ``read_json_bytes``'."""
    raw = read_file_bytes(path, what)
    return _decoded(raw, json.detect_encoding(raw), path, what)


def read_file_bytes(path: str | os.PathLike, what: str) -> bytes:
    """The bytes of the regular file ``path`` (``what`` names it in the messages).

    Raises:
        FileNotFoundError: no such file; DataError: a folder, a link to nothing, a
            device or a named pipe (whose ``open`` would wait for a writer for ever), or
            unreadable.
    """
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise DataError(no_file_message(what, path))
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise FileNotFoundError(no_file_message(what, path)) from None
    except OSError as exc:
        raise DataError(f"{what} {path} cannot be read: {exc.strerror or exc}") from None


def _decoded(raw: bytes, encoding: str, path: str | os.PathLike, what: str) -> str:
    try:
        return raw.decode(encoding)
    except UnicodeError as exc:
        raise DataError(f"{what} {path} is not valid {encoding.removesuffix('-sig')} text ({exc.reason} at byte "
                        f"{exc.start})") from None


def to_rgb8(img: Image.Image, what: str) -> np.ndarray:
    """A decoded PIL image as uint8 ``[H, W, 3]`` RGB, scaled correctly from any bit depth.

    - 16-bit grayscale (modes ``I;16``, ``I;16B``, ``I;16L``; ``I`` from a PNG, which can
      only be 16-bit) maps the full range 0..65535 linearly onto 0..255:
      ``round(v * 255 / 65535)`` = ``round(v / 257)``, so 65535 -> 255 and 0 -> 0.
      (PIL's own ``convert("RGB")`` clips every value above 255 to 255, a blank image.)
      16-bit RGB(A) PNGs are already reduced to 8 bits by PIL when opened (high byte).
    - 32-bit integer (``I``, other than PNG) and 32-bit float (``F``) pixels have no
      defined 8-bit scale (a float TIFF may hold 0..1, 0..255 or physical units), so
      they are refused with a ``DataError`` naming the file and mode.
    - Every other mode (``L``, ``P``, ``LA``, ``PA``, ``RGBA``, ``CMYK``, ``1``, ``YCbCr``,
      ...) goes through PIL's ``convert("RGB")``; alpha is dropped, CMYK is converted
      without a colour profile.
    """
    mode = img.mode
    if mode.startswith("I;16") or (mode == "I" and img.format == "PNG"):
        gray = np.clip(np.asarray(img).astype(np.int64), 0, 65535)
        gray8 = ((gray * 255 + 65535 // 2) // 65535).astype(np.uint8)
        return np.repeat(gray8[:, :, None], 3, axis=2)
    if mode in ("I", "F"):
        kind = "32-bit integer" if mode == "I" else "32-bit float"
        raise DataError(f"{what} has {kind} pixels (mode {mode}) with no defined 8-bit scale; "
                        f"save it as an 8- or 16-bit image")
    if mode != "RGB":
        img = img.convert("RGB")
    return np.asarray(img)


def load_image(path: str, image_id: Optional[int] = None) -> np.ndarray:
    """Decode an image file to uint8 RGB ``[H, W, 3]`` as stored (no EXIF rotation:
    annotation sizes refer to the stored pixel array); other bit depths as in ``to_rgb8``.

    Raises:
        FileNotFoundError: the file does not exist.
        DataError: the file cannot be decoded (truncated or corrupt), or its pixel type
            has no defined 8-bit scale.
    """
    return decode_image(path, image_id).array


class DecodedImage(NamedTuple):
    """What ``decode_image`` read: ``array`` uint8 RGB ``[H, W, 3]``; ``orientation`` the
    EXIF orientation (1 or 0: stored as displayed; 2..8: a camera's rotation or mirror,
    shown turned by viewers); ``frames`` the file's frame count (above 1: an animation or
    a multi-page file, of which ``array`` is the first frame)."""

    array: np.ndarray
    orientation: int
    frames: int


def decode_image(path: str, image_id: Optional[int] = None, apply_exif: bool = False) -> DecodedImage:
    """The ``DecodedImage`` of an image file.

    ``apply_exif`` (``data.apply_exif``): turn the pixels as a viewer shows them
    (``PIL.ImageOps.exif_transpose``), for boxes annotated on the displayed image; the
    array then has the displayed size (H and W swapped by a quarter turn). Errors as in
    ``load_image``.
    """
    what = f"image file {shown_path(path)}" + (f" (image_id {image_id})" if image_id is not None else "")
    if not os.path.isfile(path):  # a pipe would make open() wait for a writer, for ever
        state = missing_file_state(path)
        if state == "not found":
            raise FileNotFoundError(f"{what} not found")
        raise DataError(f"{what} {state}")
    try:
        with Image.open(path) as img:
            img.load()
            orientation = exif_orientation(img)
            if apply_exif and orientation not in (0, 1):
                img = ImageOps.exif_transpose(img)
            array = to_rgb8(img, what)
            frames = int(getattr(img, "n_frames", 1) or 1)
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} not found") from None
    except DataError:
        raise
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        reason = first_line(exc)
        raise DataError(f"cannot decode {what}: {reason}") from None
    return DecodedImage(array, orientation, frames)


def exif_orientation(img: Image.Image) -> int:
    """The EXIF orientation tag (0x0112) of an opened image; 0 when absent or unreadable."""
    try:
        value = img.getexif().get(EXIF_ORIENTATION_TAG, 0)
    except (OSError, ValueError, SyntaxError, TypeError):
        return 0
    return value if isinstance(value, int) else 0


def exif_warning(path: str, orientation: int) -> str:
    """The warning for an image stored rotated (EXIF orientation 2..8) read as stored."""
    return (f"image file {path} has EXIF orientation {orientation} (viewers show it turned); it is read as stored, "
            "so its boxes must refer to the stored pixels: set data.apply_exif=true if they were drawn on the "
            "displayed image")



def frames_warning(path: str, frames: int) -> str:
    """The warning for a file of several frames (an animated GIF, WebP or PNG, a
    multi-page TIFF), of which the first is read."""
    return f"image file {path} holds {frames} frames (an animation or a multi-page file); only the first is read"


def decoded_warnings(path: str, decoded: DecodedImage, apply_exif: bool) -> List[str]:
    """What to say of the file ``path`` read as ``decoded`` (``decode_image`` with
    ``apply_exif``): an EXIF rotation read as stored (``exif_warning``), frames after the
    first left unread (``frames_warning``)."""
    said = []
    if decoded.orientation not in (0, 1) and not apply_exif:
        said.append(exif_warning(path, decoded.orientation))
    if decoded.frames > 1:
        said.append(frames_warning(path, decoded.frames))
    return said


def path_within(root: str, name: str) -> Optional[str]:
    """``root/name``, or None when ``name`` is empty, absolute or climbs out of ``root``
    with ``..`` (checked on the text, no file access). Symbolic links inside ``root`` are
    followed: linking files into an image folder is a common, deliberate set-up."""
    if not name or os.path.isabs(name) or os.path.splitdrive(name)[0]:
        return None
    rel = os.path.normpath(name)
    if rel == os.pardir or rel.startswith(os.pardir + os.sep):
        return None
    return os.path.join(root, rel)

