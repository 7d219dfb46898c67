"""Data-parallel ranks simulated by threads in one process, for fast property tests.

``ThreadGroup(world_size).collective(rank)`` is a real in-process implementation of
:class:`lossweight.Collective`: every rank contributes its tensor, and ``wait()`` blocks until all
ranks have contributed to that same call, then writes the sum into its rank's tensor. Ranks
that issue different numbers of collectives fail with a timeout, where a real process group
would hang. The multi-process tests use real torch.distributed process groups instead.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch

T = TypeVar("T")


class ThreadGroup:
    def __init__(self, world_size: int, timeout: float = 30.0) -> None:
        self.world_size = world_size
        self._timeout = timeout
        self._condition = threading.Condition()
        self._contributions: dict[int, dict[int, torch.Tensor]] = {}
        self._aborted = False
        self.calls = 0  # all-reduces issued by rank 0

    def collective(self, rank: int) -> ThreadCollective:
        return ThreadCollective(self, rank)

    def abort(self) -> None:
        with self._condition:
            self._aborted = True
            self._condition.notify_all()

    def _contribute(self, index: int, rank: int, tensor: torch.Tensor) -> None:
        with self._condition:
            self._contributions.setdefault(index, {})[rank] = tensor.clone()
            if rank == 0:
                self.calls += 1
            self._condition.notify_all()

    def _sum(self, index: int) -> torch.Tensor:
        with self._condition:
            complete = self._condition.wait_for(
                lambda: self._aborted or len(self._contributions[index]) == self.world_size,
                timeout=self._timeout,
            )
            if self._aborted or not complete:
                raise RuntimeError(f"all-reduce {index} never completed: the ranks disagree")
            parts = self._contributions[index]
            return sum(parts[rank] for rank in range(self.world_size))


class ThreadCollective:
    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self._group = group
        self._rank = rank
        self._issued = 0
        self.world_size = group.world_size
        self.device = torch.device("cpu")

    def can_reduce_on(self, device: torch.device) -> bool:
        return device.type == "cpu"

    def all_reduce_sum(self, tensor: torch.Tensor) -> _Pending:
        index = self._issued
        self._issued += 1
        self._group._contribute(index, self._rank, tensor)
        return _Pending(self._group, index, tensor)


class _Pending:
    def __init__(self, group: ThreadGroup, index: int, tensor: torch.Tensor) -> None:
        self._group, self._index, self._tensor = group, index, tensor

    def wait(self) -> None:
        self._tensor.copy_(self._group._sum(self._index))


def run_ranks(world_size: int, work: Callable[[int, ThreadCollective], T]) -> list[T]:
    """Run ``work(rank, collective)`` for every rank in its own thread; return the results."""
    group = ThreadGroup(world_size)
    results: list[Any] = [None] * world_size
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            results[rank] = work(rank, group.collective(rank))
        except BaseException as error:  # re-raised in the caller's thread
            errors.append(error)
            group.abort()

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results
