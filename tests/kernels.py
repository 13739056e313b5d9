"""Skip markers for tests of the C kernels: they need a C compiler (gcc); without
one the engine falls back to PyTorch, which the rest of the suite covers, and
the skip says why instead of failing."""

from __future__ import annotations

import pytest

from pipeserve.kernels import build


def kernel_missing(name: str) -> str | None:
    """Why ``pipeserve/kernels/<name>.c`` cannot be built here, or None."""
    try:
        build.load_kernel(name)
    except build.KernelBuildError as exc:
        return f"the C kernel {name}.c cannot be built here: {exc}"
    return None


def skip_without_kernel(name: str) -> pytest.MarkDecorator:
    missing = kernel_missing(name)
    return pytest.mark.skipif(missing is not None, reason=str(missing))
