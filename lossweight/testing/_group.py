"""Data-parallel ranks simulated in one process: a real :class:`~lossweight.Collective` each."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch

T = TypeVar("T")


class InProcessGroup:
    """``world_size`` data-parallel ranks simulated in one process.

    ``group.collective(rank)`` is a real :class:`lossweight.Collective` for one rank: its
    ``all_reduce_sum`` records the rank's contribution and returns at once; the handle's
    ``wait()`` blocks until every rank has contributed to that same call (its first, its
    second, ...), then writes the sum into the rank's tensor. So the ranks can run in threads
    of their own, as :meth:`run` does, or be driven in turn from one thread as long as each
    rank's reduction is started before a rank waits for it (``begin()`` of a count-first step
    on every rank, then the microbatches). A wait that cannot complete (the ranks issued their
    collectives in different numbers or orders, where a real process group would hang) fails
    with RuntimeError after ``timeout`` seconds, or at once once a rank has failed in
    :meth:`run`.

    It is fast enough for property tests of hundreds of examples: a reduction is a few tensor
    copies and additions.
    """

    def __init__(self, world_size: int, timeout: float = 60.0) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size={world_size!r} is not supported; pass a positive int")
        self.world_size = world_size
        self._timeout = timeout
        self._condition = threading.Condition()
        self._contributions: dict[int, dict[int, torch.Tensor]] = {}
        self._issued = [0] * world_size
        self._failed: BaseException | None = None

    def collective(self, rank: int) -> InProcessCollective:
        """The collective of ``rank`` (0 to ``world_size - 1``)."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank!r}; pass a rank from 0 to {self.world_size - 1}")
        return InProcessCollective(self, rank)

    @property
    def calls(self) -> list[int]:
        """How many all-reduces each rank has issued."""
        return list(self._issued)

    def run(self, work: Callable[[int, InProcessCollective], T]) -> list[T]:
        """Run ``work(rank, collective)`` for every rank, each in a thread of its own, and
        return their results in rank order. If a rank raises, the others' waits fail at once
        and the first error is raised here."""
        results: list[Any] = [None] * self.world_size
        errors: list[BaseException] = []

        def run_rank(rank: int) -> None:
            try:
                results[rank] = work(rank, self.collective(rank))
            except BaseException as error:  # re-raised in the caller's thread
                errors.append(error)
                with self._condition:
                    self._failed = self._failed or error
                    self._condition.notify_all()

        threads = [
            threading.Thread(target=run_rank, args=(rank,)) for rank in range(self.world_size)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        return results

    def _contribute(self, rank: int, tensor: torch.Tensor) -> int:
        with self._condition:
            index = self._issued[rank]
            self._issued[rank] += 1
            self._contributions.setdefault(index, {})[rank] = tensor.detach().clone()
            self._condition.notify_all()
            return index

    def _sum(self, index: int, rank: int) -> torch.Tensor:
        with self._condition:
            complete = self._condition.wait_for(
                lambda: (
                    self._failed is not None or len(self._contributions[index]) == self.world_size
                ),
                timeout=self._timeout,
            )
            if self._failed is not None:
                raise RuntimeError(
                    f"all-reduce {index} of rank {rank} abandoned: another rank failed"
                )
            if not complete:
                missing = sorted(set(range(self.world_size)) - set(self._contributions[index]))
                raise RuntimeError(
                    f"all-reduce {index} of rank {rank} never completed: rank(s) {missing} did "
                    f"not start it within {self._timeout:g} s (the ranks issued their "
                    f"collectives in different numbers or orders; issued so far: {self._issued})"
                )
            parts = self._contributions[index]
            return torch.stack([parts[r] for r in range(self.world_size)]).sum(0)


class InProcessCollective:
    """One rank of an :class:`InProcessGroup`; reduces CPU tensors."""

    device = torch.device("cpu")

    def __init__(self, group: InProcessGroup, rank: int) -> None:
        self.group = group
        self.rank = rank
        self.world_size = group.world_size

    @property
    def calls(self) -> int:
        """How many all-reduces this rank has issued."""
        return self.group.calls[self.rank]

    def can_reduce_on(self, device: torch.device) -> bool:
        return device.type == "cpu"

    def all_reduce_sum(self, tensor: torch.Tensor) -> _Pending:
        return _Pending(self.group, self.group._contribute(self.rank, tensor), self.rank, tensor)


class _Pending:
    def __init__(self, group: InProcessGroup, index: int, rank: int, tensor: torch.Tensor) -> None:
        self._group, self._index, self._rank, self._tensor = group, index, rank, tensor

    def wait(self) -> None:
        self._tensor.copy_(self._group._sum(self._index, self._rank))
