"""Data-parallel ranks simulated in one process and driven from one thread, in lockstep.

``LockstepGroup(world_size).collective(rank)`` is a real implementation of
:class:`lossweight.Collective` for each of ``world_size`` simulated ranks. A test calls every
rank's Accumulator in turn, from one thread: ``all_reduce_sum`` records a copy of the rank's
tensor under the index of the call (its first call is index 0, its second index 1, ...) and
returns a handle; the handle's ``wait()`` writes the sum of every rank's contribution to that
index into the rank's tensor. A ``wait()`` before every rank has contributed to its index
raises RuntimeError at once instead of blocking: driven from one thread, nobody else could
ever contribute, so it is a bug of the test (or ranks that issue their collectives in a
different number or order, which a real process group would hang on).

One call of the library does wait for its own all-reduce before it returns: ``end()`` of a
scale-after step, which needs the global count to rescale the gradients. A single thread cannot
run it rank by rank, so :meth:`LockstepGroup.together` runs one such call on every rank at once,
each in a thread of its own; inside it, a ``wait()`` blocks until the other ranks contribute,
and raises at once if every rank still running is waiting for a sum that cannot complete.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch


class LockstepGroup:
    """``world_size`` simulated ranks whose all-reduces are summed in one process."""

    def __init__(self, world_size: int, together_timeout: float = 60.0) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size={world_size!r}; pass a positive int")
        self.world_size = world_size
        self._timeout = together_timeout
        self._condition = threading.Condition()
        # Per call index: each rank's contribution (a copy of its tensor when it called).
        self._contributions: dict[int, dict[int, torch.Tensor]] = {}
        self._waited: dict[int, set[int]] = {}
        self._issued = [0] * world_size  # collectives issued by each rank
        # Set only inside together(): the ranks still running, and those blocked in wait().
        self._running: set[int] | None = None
        self._blocked: dict[int, int] = {}
        self._failure: str | None = None

    def collective(self, rank: int) -> LockstepCollective:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank}; pass a rank from 0 to {self.world_size - 1}")
        return LockstepCollective(self, rank)

    def issued(self, rank: int) -> int:
        """How many all-reduces ``rank`` has issued."""
        return self._issued[rank]

    @property
    def calls(self) -> int:
        """How many all-reduces every rank has issued (they must agree)."""
        if len(set(self._issued)) != 1:
            raise RuntimeError(f"the ranks issued different numbers of all-reduces: {self._issued}")
        return self._issued[0]

    def together(
        self, calls: Sequence[Callable[[], Any]], return_exceptions: bool = False
    ) -> list[Any]:
        """Run ``calls[rank]()`` for every rank at once, each in its own thread.

        Returns their results in rank order. If some raise, every thread is still joined; then
        with ``return_exceptions`` each exception takes its rank's place in the results, and
        without it the lowest rank's exception is re-raised (with the others' as notes).
        """
        if len(calls) != self.world_size:
            raise ValueError(f"together() got {len(calls)} calls for {self.world_size} ranks")
        with self._condition:
            if self._running is not None:
                raise RuntimeError("together() is not reentrant")
            self._running = set(range(self.world_size))
            self._blocked = {}
            self._failure = None
        results: list[Any] = [None] * self.world_size
        errors: dict[int, BaseException] = {}

        def run(rank: int) -> None:
            try:
                results[rank] = calls[rank]()
            except BaseException as error:  # re-raised in the calling thread
                errors[rank] = error
            finally:
                with self._condition:
                    assert self._running is not None
                    self._running.discard(rank)
                    self._condition.notify_all()

        threads = [
            threading.Thread(target=run, args=(rank,), name=f"lockstep-rank-{rank}")
            for rank in range(self.world_size)
        ]
        try:
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        finally:
            with self._condition:
                self._running = None
                self._blocked = {}
        if errors and return_exceptions:
            return [errors.get(rank, result) for rank, result in enumerate(results)]
        if errors:
            first = min(errors)
            error = errors[first]
            for rank in sorted(errors):
                if rank != first:
                    error.add_note(f"rank {rank} raised too: {errors[rank]!r}")
            raise error
        return results

    def _contribute(self, rank: int, tensor: torch.Tensor) -> int:
        with self._condition:
            index = self._issued[rank]
            self._issued[rank] += 1
            parts = self._contributions.setdefault(index, {})
            for other, part in parts.items():
                if part.shape != tensor.shape or part.dtype != tensor.dtype:
                    raise RuntimeError(
                        f"all-reduce {index}: rank {rank} contributes a {tensor.dtype} tensor of "
                        f"shape {tuple(tensor.shape)}, rank {other} a {part.dtype} tensor of "
                        f"shape {tuple(part.shape)}"
                    )
            parts[rank] = tensor.detach().clone()
            self._condition.notify_all()
            return index

    def _missing(self, index: int) -> list[int]:
        parts = self._contributions.get(index, {})
        return [rank for rank in range(self.world_size) if rank not in parts]

    def _sum(self, rank: int, index: int) -> torch.Tensor:
        with self._condition:
            if self._running is None or rank not in self._running:
                missing = self._missing(index)
                if missing:
                    raise RuntimeError(
                        f"lockstep: rank {rank} waited for all-reduce {index} before rank(s) "
                        f"{missing} contributed to it; in lockstep, every rank must issue the "
                        "collective before any rank waits for it (run a call that waits for its "
                        "own all-reduce with LockstepGroup.together())"
                    )
            else:
                self._blocked[rank] = index
                try:
                    complete = self._condition.wait_for(
                        lambda: (
                            self._failure is not None
                            or not self._missing(index)
                            or self._deadlocked()
                        ),
                        timeout=self._timeout,
                    )
                    missing = self._missing(index)
                    if missing:
                        if self._failure is None:  # the first rank to find it explains it
                            self._failure = (
                                f"lockstep: rank {rank} waited for all-reduce {index}, which "
                                f"rank(s) {missing} never contributed to"
                                + ("" if complete else f" within {self._timeout} s")
                            )
                            self._condition.notify_all()
                        raise RuntimeError(self._failure)
                finally:
                    self._blocked.pop(rank, None)
            parts = self._contributions[index]
            total = parts[0].clone()
            for other in range(1, self.world_size):
                total += parts[other]
            waited = self._waited.setdefault(index, set())
            waited.add(rank)
            if len(waited) == self.world_size:  # nobody needs this index any more
                del self._contributions[index], self._waited[index]
            return total

    def _deadlocked(self) -> bool:
        """Inside together(): every rank still running waits for a sum that is incomplete."""
        assert self._running is not None
        return all(
            rank in self._blocked and self._missing(self._blocked[rank]) for rank in self._running
        )


class LockstepCollective:
    """One rank's :class:`lossweight.Collective` of a :class:`LockstepGroup`."""

    device = torch.device("cpu")

    def __init__(self, group: LockstepGroup, rank: int) -> None:
        self.group = group
        self.rank = rank
        self.world_size = group.world_size

    @property
    def issued(self) -> int:
        """How many all-reduces this rank has issued."""
        return self.group.issued(self.rank)

    def can_reduce_on(self, device: torch.device) -> bool:
        return device.type == "cpu"

    def all_reduce_sum(self, tensor: torch.Tensor) -> LockstepHandle:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"all_reduce_sum() got {tensor!r}, not a tensor")
        index = self.group._contribute(self.rank, tensor)
        return LockstepHandle(self.group, self.rank, index, tensor)


class LockstepHandle:
    """An all-reduce in flight; ``wait()`` writes the sum into the tensor (once)."""

    def __init__(self, group: LockstepGroup, rank: int, index: int, tensor: torch.Tensor) -> None:
        self._group, self._rank, self._index, self._tensor = group, rank, index, tensor
        self._done = False

    def wait(self) -> None:
        if self._done:
            raise RuntimeError(f"rank {self._rank} waited twice for all-reduce {self._index}")
        total = self._group._sum(self._rank, self._index)
        self._tensor.copy_(total)
        self._done = True
