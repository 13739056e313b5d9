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

from pipeserve.config import cache_root

_HERE = Path(__file__).resolve().parent
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu11"]
_BUILD_TIMEOUT_S = 300


class KernelBuildError(RuntimeError):
    """A C kernel cannot be built or loaded here (no compiler, or it failed)."""


def cache_dir() -> Path:
    return cache_root() / "kernels"


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if not cc:
        raise KernelBuildError("no C compiler found (install gcc, or set CC); "
                               "pipeserve runs its PyTorch paths without the C kernels")
    return cc


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU model and its feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(wanted)))


def load_kernel(name: str) -> ctypes.CDLL:
    """Build (if not cached) and load ``pipeserve/kernels/<name>.c``; ``KernelBuildError`` otherwise.

    A failure is remembered: in this process (every runner asks), and in the cache
    directory next to where the library would be, so that the other stage processes
    and later runs on this machine fall back at once instead of compiling again.
    Delete ``<name>-<key>.failed`` (or change the source, compiler or flags) to retry.
    """
    outcome = _load_once(name)
    if isinstance(outcome, KernelBuildError):
        raise outcome
    return outcome


@functools.lru_cache(maxsize=None)
def _load_once(name: str) -> ctypes.CDLL | KernelBuildError:
    try:
        return _build_and_load(name)
    except KernelBuildError as exc:
        return exc


_HOLDERS: list = []


def kernel_cache(fn):
    """``functools.lru_cache`` for a function that returns what holds a loaded kernel (or
    None after a failed build): ``forget_loaded`` clears it too, so a library built with
    another CC or cache dir is never kept past the change."""
    cached = functools.lru_cache(maxsize=None)(fn)
    _HOLDERS.append(cached)
    return cached


def forget_loaded() -> None:
    """Forget what this process built or failed to build, and every ``kernel_cache`` that holds
    one (tests change CC or the cache dir)."""
    _load_once.cache_clear()
    for holder in _HOLDERS:
        holder.cache_clear()


def _build_and_load(name: str) -> ctypes.CDLL:
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
    failed = target.with_suffix(".failed")
    if failed.exists():
        raise KernelBuildError(f"an earlier build of {source.name} failed here ({failed}; delete it to retry):\n"
                               f"{_read_text(failed)}")
    if not target.exists():
        target = _compile(cc, source, target, failed)
    try:
        return ctypes.CDLL(str(target))
    except OSError as exc:
        raise KernelBuildError(f"cannot load {target}: {exc}") from exc


def _compile(cc: str, source: Path, target: Path, failed: Path) -> Path:
    """Compile into ``target``'s directory, or a private temporary one when the cache cannot be written."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    except OSError:
        target = Path(tempfile.mkdtemp(prefix="pipeserve-kernels-")) / target.name
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        try:
            result = subprocess.run([cc, *_FLAGS, str(source), "-o", tmp, "-lm"],
                                    capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S)
        except (OSError, subprocess.SubprocessError) as exc:
            raise KernelBuildError(f"building {source.name} with {cc} did not finish: {exc}") from exc
        if result.returncode != 0:
            error = KernelBuildError(f"building {source.name} failed ({cc} {' '.join(_FLAGS)}):\n"
                                     f"{result.stderr.strip()[-2000:]}")
            _write_text(failed, str(error))
            raise error
        os.replace(tmp, target)
        return target
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _read_text(path: Path) -> str:
    try:
        return path.read_text()[-2000:]
    except OSError:
        return "(unreadable)"


def _write_text(path: Path, text: str) -> None:
    try:
        path.write_text(text)
    except OSError:
        pass   # an unwritable cache only costs the other processes a build attempt each
