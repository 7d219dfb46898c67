"""Data-parallel ranks simulated in one process: a real :class:`~lossweight.Collective` each."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from ..errors import error

T = TypeVar("T")


class InProcessGroup:
    """``world_size`` data-parallel ranks simulated in one process.

    ``group.collective(rank)`` is a real :class:`lossweight.Collective` for one rank: its
    ``all_reduce_sum`` records a copy of the rank's tensor and returns at once; the handle's
    ``wait()`` writes the sum of every rank's contribution to that same call (its first, its
    second, ...) into the rank's tensor. The ranks run in either of two ways, which mix freely:

    - in threads of their own, with :meth:`run`: a ``wait()`` blocks until every rank has
      contributed. One that cannot complete fails with RuntimeError at once, when another rank
      has failed or when every rank still running waits and some rank never started the sum
      (the ranks issued their collectives in different numbers or orders, where a real process
      group would hang); ``timeout`` seconds bound the others.
    - in turn, from one thread, outside :meth:`run`: every rank starts an all-reduce before
      any rank waits for it, as when ``begin()`` of a count-first step runs on every rank
      before their microbatches. No other thread is expected to contribute, so a ``wait()``
      before every rank has contributed fails with RuntimeError at once. A call that waits for
      its own all-reduce, ``end()`` of a scale-after step or ``flush()``, cannot run rank
      after rank: ``run(lambda rank, _: accumulators[rank].end())`` runs it on every rank at
      once.

    Every rank must contribute a tensor of the same shape and dtype to a call, as a real
    process group requires; one unlike another rank's fails with RuntimeError. :attr:`calls`
    counts the all-reduces each rank has issued.

    A :meth:`run` that fails leaves the group clean: the all-reduces that some rank started and
    another never did are abandoned (a ``wait()`` for one fails with RuntimeError), and every
    rank's next all-reduce pairs with the others' next, as at the start. Without that, a rank
    that failed before an all-reduce would pair its next one with a stale contribution of the
    failed run, and the report would blame the loop run next.

    It is fast enough for property tests of thousands of examples: a reduction is a few tensor
    copies and additions.
    """

    def __init__(self, world_size: int, timeout: float = 60.0) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise error(
                "bad_option", name="world_size", value=world_size, expected="a positive int"
            )
        self.world_size = world_size
        self._timeout = timeout
        self._condition = threading.Condition()
        self._contributions: dict[int, dict[int, torch.Tensor]] = {}
        self._issued = [0] * world_size
        # The call each rank's next all-reduce joins: its count of issued ones, but after a
        # failed run, where the ranks skip the calls it abandoned.
        self._next = [0] * world_size
        self._abandoned: set[int] = set()
        self._failed: BaseException | None = None
        # Only while run() runs: the ranks whose work has not returned, and the call each rank
        # blocked in wait() waits for. A wait outside run() comes from the one driving thread.
        self._running: set[int] | None = None
        self._blocked: dict[int, int] = {}

    def collective(self, rank: int) -> InProcessCollective:
        """The collective of ``rank`` (0 to ``world_size - 1``)."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise error("bad_rank", value=rank, last=self.world_size - 1)
        return InProcessCollective(self, rank)

    @property
    def calls(self) -> list[int]:
        """How many all-reduces each rank has issued."""
        return list(self._issued)

    def run(self, work: Callable[[int, InProcessCollective], T]) -> list[T]:
        """Run ``work(rank, collective)`` for every rank, each in a thread of its own, and
        return their results in rank order. If a rank raises, the others' waits fail at once,
        the all-reduces that not every rank started are abandoned, and the first error is
        raised here."""
        with self._condition:
            if self._running is not None:
                raise error("run_reentered")
            self._running = set(range(self.world_size))
            self._failed = None
        results: list[Any] = [None] * self.world_size
        errors: list[BaseException] = []

        def run_rank(rank: int) -> None:
            try:
                results[rank] = work(rank, self.collective(rank))
            except BaseException as error:  # re-raised in the caller's thread
                errors.append(error)
                with self._condition:
                    self._failed = self._failed or error
            finally:
                with self._condition:
                    assert self._running is not None
                    self._running.discard(rank)
                    self._condition.notify_all()  # the others may wait for this rank in vain

        threads = [
            threading.Thread(target=run_rank, args=(rank,)) for rank in range(self.world_size)
        ]
        try:
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        finally:
            with self._condition:
                self._running = None
                if errors:
                    self._abandon_unpaired()
        if errors:
            raise errors[0]
        return results

    def _abandon_unpaired(self) -> None:
        """Every call past the one the slowest rank would join next lacks that rank."""
        last = max(self._next)
        for index in range(min(self._next), last):
            self._abandoned.add(index)
            self._contributions.pop(index, None)
        self._next = [last] * self.world_size

    def _contribute(self, rank: int, tensor: torch.Tensor) -> int:
        with self._condition:
            index = self._next[rank]
            parts = self._contributions.setdefault(index, {})
            for other, part in parts.items():
                if part.shape != tensor.shape or part.dtype != tensor.dtype:
                    raise error(
                        "unlike_contributions",
                        index=index,
                        rank=rank,
                        dtype=tensor.dtype,
                        shape=tuple(tensor.shape),
                        other=other,
                        other_dtype=part.dtype,
                        other_shape=tuple(part.shape),
                    )
            self._issued[rank] += 1
            self._next[rank] += 1
            parts[rank] = tensor.detach().clone()
            self._condition.notify_all()
            return index

    def _missing(self, index: int) -> list[int]:
        return sorted(set(range(self.world_size)) - set(self._contributions[index]))

    def _deadlocked(self) -> bool:
        """In run(): every rank still running waits for a sum that some rank never started."""
        assert self._running is not None
        return all(
            rank in self._blocked and self._missing(self._blocked[rank]) for rank in self._running
        )

    def _sum(self, index: int, rank: int) -> torch.Tensor:
        with self._condition:
            if index in self._abandoned:
                raise error("reduce_abandoned", index=index, rank=rank)
            if self._running is None:
                missing = self._missing(index)
                if missing:
                    raise error("waited_before_started", rank=rank, index=index, missing=missing)
            else:
                self._blocked[rank] = index
                try:
                    settled = self._condition.wait_for(
                        lambda: (
                            self._failed is not None
                            or not self._missing(index)
                            or self._deadlocked()
                        ),
                        timeout=self._timeout,
                    )
                finally:
                    del self._blocked[rank]
                missing = self._missing(index)
                if missing and self._failed is not None:
                    raise error("rank_failed", index=index, rank=rank)
                if missing and settled:
                    raise error(
                        "reduce_deadlocked",
                        index=index,
                        rank=rank,
                        missing=missing,
                        issued=self._issued,
                    )
                if missing:
                    raise error(
                        "reduce_timed_out",
                        index=index,
                        rank=rank,
                        missing=missing,
                        timeout=self._timeout,
                        issued=self._issued,
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
