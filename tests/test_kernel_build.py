"""Building the C kernels fails soft: every failure is a KernelBuildError (so the engine falls back),
a failed build is not retried by every runner or process, and an unwritable cache still builds (in a private temporary directory)."""

from __future__ import annotations

import os
import stat

import pytest

from pipeserve.kernels import build
from tests.kernels import skip_without_kernel


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    monkeypatch.setenv("PIPESERVE_CACHE_DIR", str(tmp_path / "cache"))
    build.forget_loaded()
    yield tmp_path
    build.forget_loaded()


def _fake_compiler(path, body: str) -> str:
    """A 'compiler' script: answers --version, and does ``body`` when asked to compile."""
    path.write_text(f'#!/bin/sh\nif [ "$1" = "--version" ]; then echo fake-cc 1.0; exit 0; fi\n'
                    f'echo called >> "{path}.calls"\n{body}\n')
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def _calls(cc: str) -> int:
    return len(open(cc + ".calls").read().split()) if os.path.exists(cc + ".calls") else 0


def test_a_failed_build_is_remembered_across_calls_and_processes(fresh, monkeypatch):
    cc = _fake_compiler(fresh / "cc", 'echo "error: no such intrinsic" >&2; exit 1')
    monkeypatch.setenv("CC", cc)
    for _ in range(3):
        with pytest.raises(build.KernelBuildError, match="no such intrinsic"):
            build.load_kernel("elementwise")
    assert _calls(cc) == 1
    build.forget_loaded()   # as a new stage process would start
    with pytest.raises(build.KernelBuildError, match="earlier build .* failed"):
        build.load_kernel("elementwise")
    assert _calls(cc) == 1


def test_a_build_that_times_out_is_a_kernel_build_error(fresh, monkeypatch):
    monkeypatch.setenv("CC", _fake_compiler(fresh / "cc", "sleep 30"))
    monkeypatch.setattr(build, "_BUILD_TIMEOUT_S", 0.5)
    with pytest.raises(build.KernelBuildError, match="did not finish"):
        build.load_kernel("elementwise")


@skip_without_kernel("elementwise")
def test_a_cache_path_that_is_a_file_still_builds(fresh):
    (fresh / "cache").write_text("not a directory")   # mkdir of cache/kernels fails
    assert build.load_kernel("elementwise") is not None

