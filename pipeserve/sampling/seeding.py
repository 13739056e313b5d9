"""Random numbers for sampling that a seeded request can reproduce anywhere.

A seeded row's uniform comes from a fresh CPU generator seeded from
``(seed, step_index)``: it depends on nothing else (not batch mates, not the
row's position, not which stage process or device samples it), so the stage
keeps no per-request RNG state. Unseeded rows share one engine-wide generator.
Uniforms are drawn on the CPU and moved to the logits' device, so CPU and CUDA
stages draw the same numbers for the same seed.
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1


def row_seed(seed: int, step_index: int) -> int:
    """A well-mixed 64-bit seed for (seed, step): splitmix64 of a combination,
    so that nearby seeds or steps do not give correlated streams."""
    z = (seed * 0x9E3779B97F4A7C15 + step_index * 0xD1B54A32D192ED03 + 0x632BE59BD9B4E019) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def seeded_uniform(seed: int, step_index: int) -> float:
    """The one uniform in [0, 1) that a seeded row uses at this step."""
    gen = torch.Generator().manual_seed(row_seed(seed, step_index))
    return float(torch.rand((), generator=gen, dtype=torch.float64))


def draw_uniforms(seeds: list[tuple[int | None, int]], engine_gen: torch.Generator,
                  device: torch.device) -> torch.Tensor:
    """One uniform per row, [R] float64 on ``device``, from (seed, step_index) pairs."""
    unseeded = sum(1 for s, _ in seeds if s is None)
    shared = torch.rand(unseeded, generator=engine_gen, dtype=torch.float64).tolist()
    values = [shared.pop() if s is None else seeded_uniform(s, step) for s, step in seeds]
    return torch.tensor(values, dtype=torch.float64, device=device)

