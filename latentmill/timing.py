"""Honest timing of a repeated workload: the first call on its own, then the median and spread of K later calls.

The first call of a model pays for things a steady run does not: lazy initialisation, cuDNN/oneDNN algorithm
search, CUDA context and allocator growth, ``torch.compile``/XLA compilation. Counting it as speed is the
classic benchmarking mistake, so :func:`steady_state` reports it separately and never puts it in the median.
``latentmill sample`` uses it; ``make bench`` and ``make gpu-check`` can call the same function.

The clock and the device synchronisation are injectable, so tests can drive the function with a fake clock
instead of timing anything.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class SteadyState:
    """What :func:`steady_state` measured: the first call, and the K later calls (seconds each)."""

    first_s: float
    times_s: list[float]
    results: list[Any] = field(default_factory=list, repr=False)  # what each call returned, first one included

    @property
    def median_s(self) -> float | None:
        """Median of the later calls (None when there were none)."""
        return statistics.median(self.times_s) if self.times_s else None

    @property
    def min_s(self) -> float | None:
        return min(self.times_s) if self.times_s else None

    @property
    def max_s(self) -> float | None:
        return max(self.times_s) if self.times_s else None

    @property
    def iqr_s(self) -> float | None:
        """Interquartile range of the later calls (0.0 for one call, None for none)."""
        if not self.times_s:
            return None
        if len(self.times_s) == 1:
            return 0.0
        q1, _, q3 = statistics.quantiles(self.times_s, n=4, method="inclusive")
        return q3 - q1

    def per_second(self, units_per_call: float) -> float | None:
        """Steady-state throughput: ``units_per_call`` (images, samples, steps) divided by the median call."""
        median = self.median_s
        return units_per_call / median if median else None

    def to_json(self) -> dict[str, Any]:
        """The figures as a JSON-ready dict (the results are left out)."""
        return {"first_call_s": self.first_s, "repeats_s": list(self.times_s), "median_s": self.median_s,
                "min_s": self.min_s, "max_s": self.max_s, "iqr_s": self.iqr_s, "repeats": len(self.times_s)}


def steady_state(
    fn: Callable[[int], Any],
    repeats: int,
    *,
    clock: Callable[[], float] = time.perf_counter,
    sync: Callable[[], None] | None = None,
) -> SteadyState:
    """Call ``fn(0)`` once (warm-up: timed on its own), then ``fn(1)`` ... ``fn(repeats)``, each timed.

    ``sync`` (e.g. ``torch.cuda.synchronize``) runs before each clock read after a call, so asynchronous
    device work is inside the call that queued it. ``clock`` returns seconds (``time.perf_counter``).
    """
    if repeats < 0:
        raise ValueError(f"repeats must be >= 0, got {repeats}")

    def timed(index: int) -> tuple[float, Any]:
        if sync is not None:
            sync()  # nothing queued before this call is counted in it
        start = clock()
        result = fn(index)
        if sync is not None:
            sync()
        return clock() - start, result

    first_s, first = timed(0)
    times, results = [], [first]
    for index in range(1, repeats + 1):
        seconds, result = timed(index)
        times.append(seconds)
        results.append(result)
    return SteadyState(first_s=first_s, times_s=times, results=results)
