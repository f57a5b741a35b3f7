"""The image files ``tools/infer.py`` reads and the annotated images it writes: which
entries of an input folder are images (every format PIL opens), and output names checked
before any work (no input overwritten, no two outputs of one name)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

from PIL import Image

from detector.files import OutputError, missing_file_state, no_file_message

logger = logging.getLogger(__name__)


def _pil_suffixes() -> Tuple[str, ...]:
    """The file suffixes of every format PIL opens (training reads any of them)."""
    Image.init()
    return tuple(sorted(ext for ext, fmt in Image.registered_extensions().items() if fmt in Image.OPEN))


IMAGE_SUFFIXES = _pil_suffixes()


def list_images(path: str | Path) -> List[Path]:
    """One image file, or the image files of a folder (sorted, not recursive).

    Raises:
        FileNotFoundError: no such path, or a folder without images (named).
    """
    path = Path(path)
    if path.is_file():
        return [path]
    if path.is_dir():
        files, others, folders, not_images = [], [], [], []
        for p in sorted(path.iterdir()):
            if p.suffix.lower() in IMAGE_SUFFIXES:
                # others: a folder, a pipe (reading it would wait for ever), a broken link
                (files if p.is_file() else others).append(p)
            else:
                (folders if p.is_dir() else not_images).append(p)
        if others:
            logger.warning("--input %s: skipping %d entries with image names that are no files: %s (%s)", path,
                           len(others), _names(others), missing_file_state(others[0]))
        if folders or not_images:
            logger.warning("--input %s: not read: %s", path, "; ".join(
                [f"{len(folders)} subfolders (not searched: name each folder): {_names(folders)}"] * bool(folders) +
                [f"{len(not_images)} files of no image format PIL reads: {_names(not_images)}"] * bool(not_images)))
        if not files:
            raise FileNotFoundError(f"no image files (of a format PIL reads: .jpg, .png, .tif, ...) in {path}")
        return files
    raise FileNotFoundError(no_file_message("input", path))


def _names(paths: Sequence[Path], shown: int = 3) -> str:
    return ", ".join(p.name for p in paths[:shown]) + (" ..." if len(paths) > shown else "")


def output_paths(paths: Sequence[Path], output_dir: str | Path) -> List[Path]:
    """The annotated image each input file becomes: ``<output_dir>/<stem>.png``.

    Checked before any work, so no input is overwritten and no output overwrites another:

    - ``output_dir`` must not be a folder that holds input images (it would overwrite
      ``a.png``, or mix the drawings with the inputs of the next run);
    - no two inputs may give one output name (``a.jpg`` and ``a.png``; names compared
      case-insensitively, as macOS and Windows file systems do).

    Raises:
        OutputError: one line naming the inputs and the folder.
    """
    out = Path(output_dir)
    resolved_out = out.resolve()
    for path in paths:
        if Path(path).resolve().parent == resolved_out:
            raise OutputError(f"--output-dir {out} holds the input image {path}: the annotated images would "
                              "overwrite or mix with the inputs; choose another folder")
    seen: Dict[str, Path] = {}
    result = []
    for path in paths:
        name = f"{Path(path).stem}.png"
        other = seen.setdefault(name.lower(), Path(path))
        if other != Path(path):
            raise OutputError(f"input images {other} and {path} would both be written as {out / name}; "
                              "rename one of them, or run them separately")
        result.append(out / name)
    return result
