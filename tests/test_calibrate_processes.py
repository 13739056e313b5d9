"""Calibration starts helper processes; however a measurement ends, none is left running."""

from __future__ import annotations

import pytest


def test_link_measurement_that_times_out_leaves_no_process(monkeypatch):
    import multiprocessing

    from pipeserve.plan import calibrate
    monkeypatch.setattr(calibrate, "_free_port", lambda: 1)   # nobody can listen there: the workers hang
    with pytest.raises(TimeoutError, match="did not finish within 2 s"):
        calibrate.measure_gloo_link(repeats=1, timeout=2.0)
    assert multiprocessing.active_children() == []


def test_allreduce_measurement_that_times_out_leaves_no_process():
    import multiprocessing

    from pipeserve.plan import calibrate
    # Far more all-reduces than 2 s allow: the measurement gives up and ends both ranks.
    with pytest.raises(TimeoutError, match="did not finish within 2 s"):
        calibrate.measure_shm_allreduce(repeats=10**9, timeout=2.0)
    assert multiprocessing.active_children() == []
