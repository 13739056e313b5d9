"""Compile pipeserve's C kernels for this machine and load them with ctypes.

The kernels are plain C (no torch headers), so a build takes about a second.
Each is compiled once per (source, flags, compiler, CPU) into a cache
directory (``$PIPESERVE_CACHE_DIR``, default ``~/.cache/pipeserve``) under a
name hashing all four; ``-march=native`` is safe because the library is only
ever loaded on the machine that built it. Several stage processes may build
at once: each writes a private file and renames it into place.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

_HERE = Path(__file__).resolve().parent
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu11"]


class KernelBuildError(RuntimeError):
    """A C kernel cannot be built or loaded here (no compiler, or it failed)."""


def cache_dir() -> Path:
    root = os.environ.get("PIPESERVE_CACHE_DIR") or Path.home() / ".cache" / "pipeserve"
    return Path(root) / "kernels"


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if not cc:
        raise KernelBuildError("no C compiler found (install gcc, or set CC); "
                               "use --attention-backend torch to run without the C kernel")
    return cc


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU model and its feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(wanted)))


@functools.lru_cache(maxsize=None)
def load_kernel(name: str) -> ctypes.CDLL:
    """Build (if not cached) and load ``pipeserve/kernels/<name>.c``."""
    source = _HERE / f"{name}.c"
    cc = _compiler()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelBuildError(f"cannot run the C compiler {cc!r}: {exc}") from exc
    headers = "".join(h.read_text() for h in sorted(_HERE.glob("*.h")))   # included by the sources
    key = hashlib.sha256("\0".join([source.read_text(), headers, " ".join(_FLAGS), version,
                                    _cpu_signature()]).encode()).hexdigest()[:16]
    target = cache_dir() / f"{name}-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            result = subprocess.run([cc, *_FLAGS, str(source), "-o", tmp, "-lm"],
                                    capture_output=True, text=True, timeout=300)
            if result.returncode != 0:
                raise KernelBuildError(f"building {source.name} failed ({cc} {' '.join(_FLAGS)}):\n"
                                       f"{result.stderr.strip()[-2000:]}")
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    try:
        return ctypes.CDLL(str(target))
    except OSError as exc:
        raise KernelBuildError(f"cannot load {target}: {exc}") from exc
