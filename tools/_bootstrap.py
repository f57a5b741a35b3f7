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

- Ctrl-C while the tool imports torch and ``detector`` (seconds) prints the tool's one
  line, ``error: interrupted``, and exits with 130 instead of a ``KeyboardInterrupt``
  traceback through the imports; ``run_tool`` puts Python's own handler back before the
  tool's work (where a SIGINT that was ignored, as for a background job, stays ignored).
  SIGTERM then likewise prints ``error: stopped by SIGTERM while starting; nothing was
  written`` and exits with 143 (it ended the process without a word), except in one of
  several ranks (``WORLD_SIZE`` > 1, or ``SLURM_NTASKS`` > 1 under ``srun``), where SIGTERM
  keeps its default as in ``run_tool``.

Both variables are ``setdefault``: a value in the environment wins. The library itself
writes no environment variable (tests/test_no_network_at_import.py).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _interrupted_while_importing(signum: int, frame: object) -> None:
    if signum == signal.SIGTERM:
        sys.stderr.write("error: stopped by SIGTERM while starting; nothing was written\n")
    else:
        sys.stderr.write("error: interrupted\n")
    sys.stderr.flush()
    os._exit(128 + signum)  # nothing is written yet: no file to finish (130: SIGINT, 143: SIGTERM)


_interrupted_while_importing.during_imports = True  # type: ignore[attr-defined]  (run_tool replaces it)
# Only for a tool run as a program (not when a test or a notebook imports one), and not
# where the signal is ignored or handled by someone else.
_as_program = Path(sys.argv[0] if sys.argv else "").resolve().parent == Path(__file__).resolve().parent
if _as_program and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, _interrupted_while_importing)


def one_of_several_ranks(env: "os._Environ[str] | dict[str, str]" = os.environ) -> bool:
    """True under a launcher of several ranks (torchrun's ``WORLD_SIZE``, or SLURM's
    ``SLURM_NTASKS`` with ``SLURM_PROCID``, as ``detector.distributed`` reads them), read
    here without importing the project: this runs before torch is imported. While a rank
    imports, SIGTERM keeps its default: it has nothing to report yet."""
    world = env.get("WORLD_SIZE") or (env.get("SLURM_NTASKS") if "SLURM_PROCID" in env else None) or "1"
    return world.strip().isdigit() and int(world) > 1


if _as_program and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL and not one_of_several_ranks():
    signal.signal(signal.SIGTERM, _interrupted_while_importing)
