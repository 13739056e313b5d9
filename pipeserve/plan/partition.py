"""Layer partitions: uniform, manual ("19,11") and auto (balance cost under memory)."""

from __future__ import annotations

from collections.abc import Callable

from pipeserve.plan.presets import PlanInputError


def uniform_partition(num_layers: int, parts: int) -> list[int]:
    """Equal layer counts; the remainder goes to the first parts (the last holds the LM head)."""
    check_parts(num_layers, parts)
    base, extra = divmod(num_layers, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def parse_partition(text: str, num_layers: int, parts: int) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError as exc:
        raise PlanInputError(f"partition {text!r}: write layer counts like 19,11") from exc
    if len(counts) != parts or sum(counts) != num_layers or min(counts) < 1:
        raise PlanInputError(f"partition {text!r} must be {parts} positive layer counts "
                             f"summing to {num_layers}")
    return counts


def check_parts(num_layers: int, parts: int) -> None:
    if parts < 1:
        raise PlanInputError(f"the number of pipeline chunks must be >= 1, got {parts}")
    if parts > num_layers:
        raise PlanInputError(f"cannot split {num_layers} layers into {parts} pipeline chunks "
                             "(each needs at least one layer); lower --pp or --virtual-stages")


def auto_partition(num_layers: int, parts: int, chunk_cost: Callable[[int, int], float],
                   max_layers: Callable[[int], int] | None = None) -> list[int]:
    """Contiguous split minimising the slowest part.

    ``chunk_cost(part, layers)`` is the time of part ``part`` holding ``layers``
    layers (the embedding and LM head included by the caller for the end parts);
    ``max_layers(part)`` caps a part by its memory. Dynamic programming over
    (parts used, layers used): O(parts · layers²), trivial for real models.
    """
    check_parts(num_layers, parts)
    cap = max_layers or (lambda part: num_layers)
    inf = float("inf")
    # best[p][n]: minimal slowest-part time placing the first n layers on parts 0..p-1
    best = [[inf] * (num_layers + 1) for _ in range(parts + 1)]
    choice = [[0] * (num_layers + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for p in range(1, parts + 1):
        for n in range(p, num_layers - (parts - p) + 1):
            for k in range(1, min(cap(p - 1), n - (p - 1)) + 1):
                value = max(best[p - 1][n - k], chunk_cost(p - 1, k))
                if value < best[p][n]:
                    best[p][n], choice[p][n] = value, k
    if best[parts][num_layers] == inf:
        raise PlanInputError(f"no split of {num_layers} layers into {parts} parts fits in memory; "
                             "add stages or tensor parallelism, or use a device with more memory")
    counts, n = [], num_layers
    for p in range(parts, 0, -1):
        counts.append(choice[p][n])
        n -= choice[p][n]
    return counts[::-1]
