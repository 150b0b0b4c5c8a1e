"""Prep worker processes and the GPU each one uses.

With ``runner.kind: processes`` every worker process loads its own copy of the encoders (and of a
captioning model). Spread over the GPUs unit by unit, each process would load a copy on every GPU it
meets: with 8 workers on 8 GPUs, up to 8 copies per GPU. So the process pool numbers its workers
(``number_worker``, the pool's initializer: the lowest free number) and a numbered worker keeps to one
GPU, its number modulo the GPUs. In one process (threads) units spread over the GPUs by their ids, one
copy of the models per GPU. Dask and Ray workers are not numbered: give each its GPU with ``CUDA_VISIBLE_DEVICES``.
"""

from __future__ import annotations

import os

WORKER_INDEX_ENV = "LATENTMILL_WORKER_INDEX"
_held: list[int] = []  # the slot file this process holds locked for its whole life


def number_worker(slot_dir: str) -> None:
    """Process-pool initializer: take the lowest free number, held as an ``flock`` on ``slot-N`` in
    ``slot_dir`` for this process's life (a replaced worker takes the number its predecessor left), and
    keep it in ``LATENTMILL_WORKER_INDEX``."""
    try:
        import fcntl
    except ImportError:  # not POSIX: workers stay unnumbered
        return
    index = 0
    while True:
        fd = os.open(os.path.join(slot_dir, f"slot-{index}"), os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            index += 1
            continue
        _held.append(fd)
        os.environ[WORKER_INDEX_ENV] = str(index)
        return


def worker_gpu(gpus: int) -> int | None:
    """The GPU of this numbered worker process among ``gpus``; None outside a numbered worker."""
    index = os.environ.get(WORKER_INDEX_ENV)
    if index is None or gpus < 1:
        return None
    return int(index) % gpus


def unit_gpu(unit_id: str, gpus: int) -> int:
    """The GPU a work unit runs on: this worker's own, else spread over the GPUs by the unit's id."""
    own = worker_gpu(gpus)
    return own if own is not None else int(unit_id[:8], 16) % gpus
