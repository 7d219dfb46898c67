"""What lossweight reduces over: the :class:`Collective` protocol and its two implementations.

A step's numbers are summed over the data-parallel ranks by a ``Collective``: a
``torch.distributed`` process group (:class:`ProcessGroupCollective`), a single process
(:class:`SingleProcess`), or anything a user implements (another framework's communicator, or
ranks simulated in one process, as :mod:`lossweight.testing` does).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist


@runtime_checkable
class Waitable(Protocol):
    """A collective in flight; ``wait()`` returns once its result may be used."""

    def wait(self) -> Any: ...


@runtime_checkable
class Collective(Protocol):
    """Sums a 1-D float64 tensor in place over the data-parallel ranks.

    Implement it to reduce over something other than a ``torch.distributed`` process group.
    The contract, which lossweight checks where it can and relies on where it cannot:

    - ``world_size`` is the number of ranks, a positive int (checked at each ``begin()``);
    - ``all_reduce_sum(tensor)`` replaces ``tensor``, in place, by the element-wise sum of the
      tensors that every rank passed to its call of the same index: every rank calls it the
      same number of times, in the same order, with tensors of the same shape. It returns a
      :class:`Waitable` whose ``wait()`` completes the sum, or None when the sum is complete
      already (the return value is checked at each call);
    - a sum that is not in place, not a sum, or over other tensors cannot be detected cheaply:
      it gives wrong factors. :mod:`lossweight.testing`'s checker catches such a collective.
    """

    @property
    def world_size(self) -> int:
        """The number of data-parallel ranks."""
        ...

    @property
    def device(self) -> torch.device:
        """Where counts given on the CPU (Python ints included) are moved to be reduced."""
        ...

    def can_reduce_on(self, device: torch.device) -> bool:
        """Whether tensors on ``device`` can be reduced."""
        ...

    def all_reduce_sum(self, tensor: torch.Tensor) -> Waitable | None:
        """Start summing ``tensor`` in place over the ranks (see the class docstring)."""
        ...


class SingleProcess:
    """The collective of a run without data parallelism: one rank, nothing to reduce."""

    world_size = 1
    device = torch.device("cpu")

    def can_reduce_on(self, device: torch.device) -> bool:
        return True

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        return None


# Device types each torch.distributed backend reduces on.
_BACKEND_DEVICE_TYPES = {
    "gloo": ("cpu",),
    "nccl": ("cuda",),
    "xccl": ("xpu",),
    "mpi": ("cpu",),
}


class ProcessGroupCollective:
    """Reduces over a ``torch.distributed`` process group (None: the default group).

    The all-reduce is launched asynchronously and waited on only when its result is needed,
    so it overlaps the work in between: with ``torch.distributed.all_reduce(async_op=True)``,
    or, for a reduction that is always waited on (a count-first ``begin()``'s), with the
    functional all-reduce that torch.compile traces (code that wraps
    ``torch.distributed.all_reduce`` does not see that one;
    :func:`lossweight.testing.count_collectives` does). NCCL reduces CUDA tensors and gloo CPU
    tensors; a process group made of several backends (``"cpu:gloo,cuda:nccl"``) reduces on
    each of their devices.
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.world_size = dist.get_world_size(group)
        named = group if group is not None else dist.group.WORLD
        assert named is not None  # get_world_size() found the default group
        self._group_name = named.group_name
        self._device_types = _device_types(str(dist.get_backend(group)))
        if "cuda" in self._device_types and torch.cuda.is_available():
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device(self._device_types[0])

    def can_reduce_on(self, device: torch.device) -> bool:
        return device.type in self._device_types

    def all_reduce_sum(self, tensor: torch.Tensor, *, traceable: bool = False) -> Waitable | None:
        if traceable:
            # The functional collective, in place: the same process-group call, but its wait
            # is an operator that torch.compile traces, so a compiled function that uses the
            # sum (scale_loss) has no graph break. torch holds such a collective until it is
            # waited on, so it serves only reductions that are always waited on.
            torch.ops._c10d_functional.all_reduce_(tensor, "sum", self._group_name)
            return _TensorWait(tensor)
        # Looked up on the module at each call, so that code which wraps
        # torch.distributed.all_reduce (to trace collectives) sees this one too.
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        return work  # type: ignore[no-any-return]


class _TensorWait:
    """The wait of a functional collective on ``tensor``."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor

    def wait(self) -> torch.Tensor:
        """The summed tensor: the caller reads this one, not the tensor it gave, so that a
        graph torch.compile traces orders every read of the sum after the wait."""
        summed: torch.Tensor = torch.ops._c10d_functional.wait_tensor(self._tensor)
        return summed


def _device_types(backend: str) -> tuple[str, ...]:
    if ":" in backend:  # "cpu:gloo,cuda:nccl"
        return tuple(pair.split(":")[0] for pair in backend.split(","))
    return _BACKEND_DEVICE_TYPES.get(backend, ("cpu", "cuda"))


class CollectiveResolver:
    """Finds the collective of a step when the step begins, not when the Accumulator is made.

    A collective or a group given explicitly is used as given. Without either, each
    ``begin()`` looks at ``torch.distributed`` again: the default group if it is initialized
    (its collective is cached until the default group changes), else a single process. So an
    Accumulator made before ``init_process_group()``, or restored into a job of another size,
    reduces over the world that exists when its step begins.
    """

    def __init__(self, group: dist.ProcessGroup | None, collective: Collective | None) -> None:
        if collective is not None and group is not None:
            raise ValueError(
                f"group={group!r} and collective={collective!r} were both given; pass one: "
                "group for a torch.distributed process group, collective for anything else"
            )
        if collective is not None and not isinstance(collective, Collective):
            raise TypeError(
                f"collective={collective!r} is not a Collective; implement world_size, device, "
                "can_reduce_on() and all_reduce_sum() (see lossweight.Collective)"
            )
        self.explicit = collective is not None or group is not None
        self._group = group
        self._given = collective
        self._cached: tuple[object, Collective] | None = None

    def resolve(self) -> Collective:
        """The collective to reduce this step over, its world size checked."""
        collective = self._given if self._given is not None else self._from_torch_distributed()
        world_size = collective.world_size
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(
                f"collective {collective!r} has world_size={world_size!r}; a Collective's "
                "world_size must be a positive int, the number of data-parallel ranks"
            )
        return collective

    def _from_torch_distributed(self) -> Collective:
        initialized = dist.is_available() and dist.is_initialized()
        if not initialized:
            if self._group is not None:
                raise RuntimeError(
                    f"group={self._group!r} was given but torch.distributed is not initialized; "
                    "call torch.distributed.init_process_group() before the first begin(), or "
                    "pass group=None for a single process"
                )
            return _SINGLE_PROCESS
        key = self._group if self._group is not None else dist.group.WORLD
        if self._cached is None or self._cached[0] is not key:
            self._cached = (key, ProcessGroupCollective(self._group))
        return self._cached[1]


_SINGLE_PROCESS = SingleProcess()


def start_all_reduce(
    collective: Collective, tensor: torch.Tensor, *, traceable: bool = False
) -> Waitable | None:
    """``collective.all_reduce_sum(tensor)``, its return value checked. ``traceable``: the
    caller waits on the result in every case, maybe inside a graph torch.compile traces; a
    torch.distributed process group then reduces with a functional collective."""
    if traceable and isinstance(collective, ProcessGroupCollective):
        handle = collective.all_reduce_sum(tensor, traceable=True)
    else:
        handle = collective.all_reduce_sum(tensor)
    if handle is not None and not callable(getattr(handle, "wait", None)):
        raise TypeError(
            f"{type(collective).__name__}.all_reduce_sum() returned {handle!r}; it must "
            "return None (the sum is complete) or an object whose wait() completes it"
        )
    return handle
