"""What every ``tools/*.py`` does first, before it imports torch or ``detector``:
``import _bootstrap`` as its first import of the project (``python tools/x.py`` puts
``tools/`` on ``sys.path``, so this module is found from any working folder).

- ``OMP_WAIT_POLICY=PASSIVE``: OpenMP threads sleep instead of spinning while they wait
  (on a CPU shared with other processes, spinning threads make steps many times slower).
  Read when torch is imported, so set before.
- ``NO_ALBUMENTATIONS_UPDATE=1``: albumentations (imported with ``detector.data``) asks
  PyPI for a newer version at import unless this is set: offline, a warning and a wait on
  every start.
- The checkout this file is in goes first on ``sys.path``, so ``detector`` and
  ``benchmarks`` (a top-level package next to it, not installed with ``detector``)
  import from a checkout without installing anything.

Both variables are ``setdefault``: a value in the environment wins. The library itself
writes no environment variable (tests/test_no_network_at_import.py).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
