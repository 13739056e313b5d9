"""Skip markers for tests of the C kernels: they need a C compiler (gcc); without
one the engine falls back to PyTorch, which the rest of the suite covers, and
the skip says why instead of failing. And quant_matmul.c built as other CPUs
build it, once per test process (``quant_matmul_for``)."""

from __future__ import annotations

import atexit
import concurrent.futures
import shutil
import subprocess
import tempfile
from pathlib import Path

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


# quant_matmul.c as other CPUs build it. One compile takes 14-34 s (its AVX-512 and AVX2 branches
# inline deeply), and two test modules want the same few builds, so each -march is compiled once
# per test process, at -O1 (the quickest level to compile here: cascadelake 17.5 s, -O0 28.5 s,
# -O2 34.0 s; the integer paths' bits do not depend on it), all of them started on the first
# request, two at a time.
OTHER_MARCHES = ("x86-64", "haswell", "skylake-avx512", "cascadelake", "sapphirerapids")
_march_builds: dict[str, concurrent.futures.Future] = {}
_march_pool: concurrent.futures.ThreadPoolExecutor | None = None
_march_out: Path | None = None


def _compile_for(march: str, out: Path) -> tuple[Path, int, str]:
    lib = out / f"quant_matmul-{march}.so"
    result = subprocess.run([build._compiler(), "-O1", f"-march={march}", "-fopenmp", "-fPIC", "-shared",
                             "-std=gnu11", str(build._HERE / "quant_matmul.c"), "-o", str(lib), "-lm"],
                            capture_output=True, text=True)
    return lib, result.returncode, result.stderr


def quant_matmul_for(march: str) -> tuple[Path, int, str]:
    """quant_matmul.c built for ``-march=march``: (the library, the compiler's exit code, its stderr)."""
    global _march_pool, _march_out
    if _march_pool is None:
        _march_out = Path(tempfile.mkdtemp(prefix="pipeserve-march-"))
        atexit.register(shutil.rmtree, _march_out, ignore_errors=True)
        _march_pool = concurrent.futures.ThreadPoolExecutor(max_workers=2)
    for m in (march,) + OTHER_MARCHES:
        if m not in _march_builds:
            _march_builds[m] = _march_pool.submit(_compile_for, m, _march_out)
    return _march_builds[march].result()
