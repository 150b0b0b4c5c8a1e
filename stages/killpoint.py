"""A place where a test can stop a long operation and SIGKILL it (gc, compaction).

``KillPoint(env, what)`` counts the steps of an operation; when the environment variable ``env`` holds
``k``, the process prints ``"<what>: paused after k <steps>"`` at the k-th step and sleeps, so a test that
waits for that line kills it exactly between two steps. Unset (always, outside tests) it only counts.
"""

from __future__ import annotations

import os
import time


class KillPoint:
    """Counts steps; with ``os.environ[env] == k`` it pauses after the k-th (see the module docstring)."""

    def __init__(self, env: str, what: str, steps: str) -> None:
        value = os.environ.get(env)
        self.after = int(value) if value not in (None, "") else None
        self.what, self.steps = what, steps
        self.count = 0

    def step(self) -> None:
        self.count += 1
        if self.after is not None and self.count == self.after:
            print(f"{self.what}: paused after {self.count} {self.steps}", flush=True)
            time.sleep(3600)
