"""matplotlib, imported when something is drawn.

Importing pyplot and matplotlib's font machinery costs about 0.5 s of CPU (0.7 s on a
small machine), which a process that draws nothing does not pay: a training run without
evaluation, a rank of several, most tool runs. Each accessor imports on its first call
(Python caches the module after it); pyplot runs on the Agg backend (no display).
"""

from __future__ import annotations

from types import ModuleType


def pyplot() -> ModuleType:
    """``matplotlib.pyplot`` on the headless Agg backend."""
    import matplotlib

    matplotlib.use("Agg")  # must precede pyplot's first import
    import matplotlib.pyplot as plt

    return plt


def font_manager() -> ModuleType:
    """``matplotlib.font_manager`` (the fonts matplotlib knows; ``findfont``)."""
    from matplotlib import font_manager as fm

    return fm


def ft2font() -> ModuleType:
    """``matplotlib.ft2font`` (a font file's character map)."""
    from matplotlib import ft2font as ft

    return ft


def colormaps():
    """``matplotlib.colormaps`` (the registry: ``colormaps()["tab10"]``)."""
    import matplotlib

    return matplotlib.colormaps
