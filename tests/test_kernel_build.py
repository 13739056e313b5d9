"""Building the C kernels fails soft: every failure is a KernelBuildError (so the engine falls back),
a failed build is not retried by every runner or process, and an unwritable cache still builds (in a private temporary directory)."""

from __future__ import annotations

import logging
import os
import shutil
import stat

import pytest
import torch

from pipeserve.kernels import build
from pipeserve.model.attention import TorchPagedAttention
from pipeserve.model.config import ModelConfig
from pipeserve.model.cpu_attention import CpuPagedAttention, select_backend
from pipeserve.model.cpu_ops import cpu_elementwise
from pipeserve.model.llama import LlamaModel
from tests.kernels import OTHER_MARCHES, quant_matmul_for, skip_without_kernel


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



# -- one kernel file failing leaves the others on (issue 12) -------------------------------------------

def _compiler_failing_on(fresh, monkeypatch, source: str) -> None:
    """CC = the real compiler, except for ``source``, whose build fails."""
    real = shutil.which("gcc") or shutil.which("cc")
    monkeypatch.setenv("CC", _fake_compiler(
        fresh / "cc", f'case "$*" in *{source}*) echo "error: poisoned for the test" >&2; exit 1;; esac\n'
                      f'exec {real} "$@"'))
    cpu_elementwise.cache_clear()


@pytest.fixture
def clear_elementwise():
    cpu_elementwise.cache_clear()
    yield
    cpu_elementwise.cache_clear()


def _tiny_bf16_model(backend) -> LlamaModel:
    cfg = ModelConfig("LlamaForCausalLM", 100, 16, 32, 2, 2, 1, 8, 64)
    return LlamaModel(cfg, 0, 2, True, True, torch.bfloat16, "cpu", backend=backend)


def _fused_ops(model: LlamaModel) -> set:
    return {type(m).__name__ if m.ops is None else "fused" for m in model.modules() if hasattr(type(m), "ops")}


def _kernel_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


@skip_without_kernel("elementwise")
def test_the_torch_attention_backend_keeps_the_fused_kernels(clear_elementwise):
    assert _fused_ops(_tiny_bf16_model(select_backend("torch", "cpu"))) == {"fused"}
    float_model = LlamaModel(ModelConfig("LlamaForCausalLM", 100, 16, 32, 2, 2, 1, 8, 64), 0, 2, True, True,
                             torch.float32, "cpu")
    assert "fused" not in _fused_ops(float_model)   # float32 stays on PyTorch (the reference)


@skip_without_kernel("paged_attention")
def test_a_failed_elementwise_build_leaves_the_attention_kernel_on(fresh, monkeypatch, caplog, clear_elementwise):
    _compiler_failing_on(fresh, monkeypatch, "elementwise.c")
    with caplog.at_level(logging.WARNING):
        for _ in range(2):   # a second stage in the same process does not warn again
            backend = select_backend("auto", "cpu")
            model = _tiny_bf16_model(backend)
    assert isinstance(backend, CpuPagedAttention)
    assert "fused" not in _fused_ops(model)
    warnings = _kernel_warnings(caplog)
    assert len(warnings) == 1 and "elementwise.c" in warnings[0] and "poisoned" in warnings[0]


@skip_without_kernel("elementwise")
def test_a_failed_attention_build_leaves_the_fused_kernels_on(fresh, monkeypatch, caplog, clear_elementwise):
    _compiler_failing_on(fresh, monkeypatch, "paged_attention.c")
    with caplog.at_level(logging.WARNING):
        backend = select_backend("auto", "cpu")
        model = _tiny_bf16_model(backend)
    assert type(backend) is TorchPagedAttention
    assert _fused_ops(model) == {"fused"}
    warnings = _kernel_warnings(caplog)
    assert len(warnings) == 1 and "paged_attention.c" in warnings[0] and "poisoned" in warnings[0]


@skip_without_kernel("quant_matmul")
@pytest.mark.parametrize("march", OTHER_MARCHES)
def test_the_quantized_kernels_compile_for_every_instruction_set(march, tmp_path):
    """The portable, AVX2, AVX-512 (VNNI-less) and AVX512_BF16 + VNNI branches of the quantized
    kernels and the loader's widening compile, as machines other than this one build them (AVX-512
    ones compile the AVX2 i4/q2/q3 code too; the VNNI-less one has no integer decode for them)."""
    import subprocess
    _, code, stderr = quant_matmul_for(march)     # the slow one, shared with test_quant_kernels
    assert code == 0, ("quant_matmul", march, stderr[-2000:])
    for name in ("quant_gemm", "gguf_widen", "decode_stage"):
        result = subprocess.run([build._compiler(), "-O1", f"-march={march}", "-fopenmp", "-fPIC", "-std=gnu11",
                                 "-c", str(build._HERE / f"{name}.c"), "-o", str(tmp_path / f"{name}.o")],
                                capture_output=True, text=True)
        assert result.returncode == 0, (name, march, result.stderr[-2000:])


@skip_without_kernel("quant_matmul")
def test_forgetting_the_loaded_kernels_reaches_every_holder(monkeypatch, tmp_path):
    """What holds a loaded library (the quantized matmuls, the fused elementwise ops, the
    bfloat16 GEMM, the GGUF repack and widen) is built again after ``forget_loaded``: a test
    that forces another CC never leaves its build behind for the rest of the process."""
    from pipeserve.model.packed_linear import gemm_kernel
    from pipeserve.model.quant.cpu_kernels import cpu_kernels
    from pipeserve.model.quant.gguf_repack import _c_repack
    from pipeserve.model.quant.gguf_widen import _c_widen
    holders = [cpu_kernels, cpu_elementwise, _c_repack, _c_widen]
    if gemm_kernel() is not None:   # bf16_gemm.c builds only where the CPU has AVX512_BF16
        holders.append(gemm_kernel)
    assert all(holder() is not None for holder in holders)
    monkeypatch.setenv("PIPESERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", _fake_compiler(tmp_path / "cc", "exit 1"))
    build.forget_loaded()
    try:
        assert [holder() for holder in holders] == [None] * len(holders)   # each asked the failing CC
    finally:
        monkeypatch.undo()
        build.forget_loaded()
    assert all(holder() is not None for holder in holders)              # the native build again
