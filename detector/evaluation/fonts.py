"""The font that draws class names in the plots (matplotlib) and on drawn images (PIL).

matplotlib's default font, DejaVu Sans (shipped with it), draws Latin, Greek and Cyrillic
text but no Chinese, Japanese or Korean; PIL's default font draws Latin only. Other
names came out as empty boxes, with one matplotlib warning per character and plot.
``text_font`` finds an installed font that draws every character of the names (DejaVu
Sans where it does); where none does, one warning names the characters, once a process.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import unicodedata
import warnings
from typing import FrozenSet, Iterable, Iterator, NamedTuple, Optional, Tuple

from PIL import ImageFont

from .mpl import font_manager, ft2font, pyplot

logger = logging.getLogger(__name__)

DEFAULT_FONT = "DejaVu Sans"
# Fonts that draw a placeholder for every code point (matplotlib ships one): never chosen.
PLACEHOLDER_FONTS = ("Last Resort",)


class TextFont(NamedTuple):
    """The font chosen for some text: ``name`` (a matplotlib family name) and ``path``
    (its file), or None for the defaults; ``missing``: the characters it does not draw."""

    name: Optional[str]
    path: Optional[str]
    missing: str


@functools.lru_cache(maxsize=None)
def _code_points(path: str) -> FrozenSet[int]:
    """The characters the font file ``path`` draws (its character map)."""
    try:
        return frozenset(ft2font().FT2Font(path).get_charmap())
    except (OSError, RuntimeError, ValueError):  # a font file FreeType cannot read
        return frozenset()


@functools.lru_cache(maxsize=None)
def _installed_fonts() -> Tuple[Tuple[str, str], ...]:
    """``(name, path)`` of the regular faces (upright, normal weight and width) of the
    fonts matplotlib knows, DejaVu Sans first: the faces names are drawn in."""
    fonts = [(f.name, f.fname) for f in font_manager().fontManager.ttflist
             if not f.name.startswith(PLACEHOLDER_FONTS) and f.style == "normal" and f.stretch == "normal"
             and f.weight in (400, "normal", "regular")]
    return tuple(sorted(set(fonts), key=lambda f: (f[0] != DEFAULT_FONT, f[0], f[1])))


def _drawn(text: str) -> FrozenSet[int]:
    """The characters of ``text`` that need a glyph (not spaces or control characters)."""
    return frozenset(ord(c) for c in text if not c.isspace() and unicodedata.category(c)[0] != "C")


def text_font(texts: Iterable[str]) -> TextFont:
    """The installed font that draws every character of ``texts``: ``(None, None, "")``
    (the defaults) where DejaVu Sans does; else the first font that does; else the one
    that draws most of them, with the characters it lacks, and one warning naming those
    that no installed font draws."""
    needed = frozenset().union(*(_drawn(t) for t in texts))
    best, best_missing, undrawn = None, needed, needed
    for name, path in _installed_fonts():
        missing = needed - _code_points(path)
        if not missing:
            return TextFont(None, None, "") if name == DEFAULT_FONT else TextFont(name, path, "")
        if len(missing) < len(best_missing):
            best, best_missing = (name, path), missing
        undrawn = undrawn & missing
    if undrawn:
        _warn_undrawn("".join(sorted(chr(c) for c in undrawn)))
    shown = "".join(sorted(chr(c) for c in best_missing))
    return TextFont(best[0], best[1], shown) if best else TextFont(None, None, shown)


@functools.lru_cache(maxsize=None)
def _warn_undrawn(characters: str) -> None:
    """One warning a process for each set of characters no installed font draws."""
    logger.warning("no installed font draws the characters %r of the class names: they are drawn as boxes in the "
                   "plots and pictures (the JSON and CSV files name them right); install a font that has them, e.g. "
                   "Noto Sans CJK for Chinese, Japanese and Korean", characters)


@contextlib.contextmanager
def plot_font(texts: Iterable[str]) -> Iterator[TextFont]:
    """matplotlib figures made and saved within draw ``texts`` with ``text_font``'s
    font (DejaVu Sans as the fallback of each character), and say once what no font
    draws instead of matplotlib's warning per character and figure."""
    font = text_font(texts)
    chosen = {"font.family": [font.name, DEFAULT_FONT]} if font.name else {}  # else the user's matplotlibrc
    with pyplot().rc_context(chosen), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Glyph \d+ .* missing from font")
        yield font


def image_font(texts: Iterable[str], size: int) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    """A PIL font of ``size`` px that draws ``texts``: PIL's default for ASCII text (as
    before), else ``text_font``'s font, or DejaVu Sans."""
    texts = list(texts)
    if all(t.isascii() for t in texts):
        return ImageFont.load_default(size=size)
    font = text_font(texts)
    path = font.path or font_manager().findfont(font_manager().FontProperties(family=DEFAULT_FONT))
    return ImageFont.truetype(path, size)
