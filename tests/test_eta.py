"""The log's ETA (``engine.log.eta_seconds``): the median time per iteration of the
recent logging windows, so that one slow window (the first one's compilation and
CUDA-graph capture, which took 3 minutes on the GPU demo and made the mean-based
estimate say 1:10:34 for an 11-second remainder) stops setting it once three windows
are in."""

from __future__ import annotations

import pytest

from detector.engine.log import eta_seconds, format_eta


def test_one_slow_window_does_not_set_the_eta_once_three_are_in():
    compile_window = 184.0 / 50  # seconds per iteration of a first window that compiled
    steady = 0.009
    assert eta_seconds([compile_window], 1150) == pytest.approx(compile_window * 1150)  # nothing else known yet
    assert eta_seconds([compile_window, steady, steady], 1050) == pytest.approx(steady * 1050)
    assert format_eta(eta_seconds([compile_window, steady, steady, steady, steady], 1000)) == "0:00:09"


def test_a_steady_run_and_no_window_yet():
    assert eta_seconds([0.5] * 5, 100) == pytest.approx(50.0)
    assert eta_seconds([0.4, 0.6], 10) == pytest.approx(5.0)  # two windows: their mean
    assert eta_seconds([], 100) == 0.0
