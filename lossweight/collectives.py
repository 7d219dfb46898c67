"""What lossweight reduces over: the :class:`Collective` protocol, and its implementations for
a ``torch.distributed`` process group and a single process. A user implements it for anything
else: another framework's communicator, or ranks simulated in one process (as
:mod:`lossweight.testing` does)."""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from . import _torch
from .errors import error

if TYPE_CHECKING:
    from .terms import Layout


@runtime_checkable
class Waitable(Protocol):
    """A collective in flight; ``wait()`` returns once its result may be used."""

    def wait(self) -> Any: ...


@runtime_checkable
class Collective(Protocol):
    """Sums a 1-D float64 tensor in place over the data-parallel ranks.

    - ``world_size`` is the number of ranks, a positive int (checked at each ``begin()``);
    - ``device`` is where counts given on the CPU (Python ints included) are moved to;
    - ``can_reduce_on(device)`` says whether tensors on ``device`` can be reduced;
    - ``all_reduce_sum(tensor)`` replaces ``tensor``, in place, by the element-wise sum of the
      tensors every rank passed to its call of the same index (every rank calls it as often,
      in the same order, with tensors of one shape). It returns a :class:`Waitable` whose
      ``wait()`` completes the sum, or None when the sum is complete already.

    A sum that is not in place, not a sum, or over other tensors cannot be detected cheaply and
    gives wrong factors; :mod:`lossweight.testing`'s checker catches such a collective.
    """

    @property
    def world_size(self) -> int: ...

    @property
    def device(self) -> torch.device: ...

    def can_reduce_on(self, device: torch.device) -> bool: ...

    def all_reduce_sum(self, tensor: torch.Tensor) -> Waitable | None: ...


Microbatches = Mapping[str, Sequence[object] | torch.Tensor | None]  # each count's, in order


class ParallelLayout(Protocol):
    """What a process group's reduction spans beyond the ranks of different data, and how those
    ranks are checked: :mod:`lossweight.parallel` implements it for a ``DeviceMesh``. The core
    reaches a mesh through this interface alone, so that a vendored copy of plain data
    parallelism leaves ``parallel.py`` out.

    - ``group()``: the process group to reduce over, made when a step begins;
    - ``replicas(world_size)``: the ranks of different data among the reduction's, ``D``'s world;
    - ``extend()``: a payload before it is reduced, with this rank's slots of the layout's own
      checks appended (none: the payload as it is), and its count and loss slots zeroed where
      another rank of the same data adds them up;
    - ``agreement()``: from those slots summed (the payload's after its ``layout.length``),
      whether each of the layout's checks passes, a bool each;
    - ``messages()``: the words of each check, for a compiled assert;
    - ``refusal()``: the error of the checks that fail, from every check of the payload (the
      layout's are the last).
    """

    def group(self) -> dist.ProcessGroup: ...

    def replicas(self, world_size: int) -> int: ...

    def extend(
        self, payload: torch.Tensor, layout: Layout, microbatches: Microbatches
    ) -> torch.Tensor: ...

    def agreement(self, summed: torch.Tensor) -> torch.Tensor: ...

    def messages(self) -> list[str]: ...

    def refusal(self, passed: Sequence[bool]) -> Exception: ...


class SingleProcess:
    """The collective of a run without data parallelism: one rank, nothing to reduce."""

    world_size = 1
    device = torch.device("cpu")

    def can_reduce_on(self, device: torch.device) -> bool:
        return True

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        return None


_SINGLE_PROCESS = SingleProcess()


# Device types each torch.distributed backend reduces on.
_BACKEND_DEVICE_TYPES = {"gloo": ("cpu",), "nccl": ("cuda",), "xccl": ("xpu",), "mpi": ("cpu",)}


class ProcessGroupCollective:
    """Reduces over a ``torch.distributed`` process group (None: the default group), with
    ``all_reduce(async_op=True)``, or, for a reduction that is always waited on (a count-first
    ``begin()``'s), with the functional all-reduce that torch.compile traces. A group of several
    backends (``"cpu:gloo,cuda:nccl"``) reduces on each of their devices. ``parallel``: the
    :class:`ParallelLayout` the group spans, if any."""

    def __init__(
        self, group: dist.ProcessGroup | None = None, parallel: ParallelLayout | None = None
    ) -> None:
        # Held weakly: a process group that outlives destroy_process_group() is torn down at
        # interpreter exit, where gloo may abort the process.
        self._group = None if group is None else weakref.ref(group)
        self.world_size, self.parallel = dist.get_world_size(group), parallel
        named = group if group is not None else dist.group.WORLD
        assert named is not None  # get_world_size() found the default group
        self._group_name, backend = named.group_name, str(dist.get_backend(group))
        if ":" in backend:
            self._device_types = tuple(pair.split(":")[0] for pair in backend.split(","))
        else:
            self._device_types = _BACKEND_DEVICE_TYPES.get(backend, ("cpu", "cuda"))
        if "cuda" in self._device_types and torch.cuda.is_available():
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device(self._device_types[0])

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The process group (None: the default group), while torch still holds it."""
        if self._group is None:
            return None
        if (group := self._group()) is None:
            raise error("group_destroyed", group=self._group_name)
        return group

    def can_reduce_on(self, device: torch.device) -> bool:
        return device.type in self._device_types

    def all_reduce_sum(self, tensor: torch.Tensor, *, traceable: bool = False) -> Waitable | None:
        if traceable and _torch.compiled is not None:
            # torch holds a functional collective until it is waited on, so it serves only
            # reductions that always are.
            return _torch.compiled.FunctionalAllReduce(tensor, self._group_name)
        # Looked up on the module at each call, so that code which wraps
        # torch.distributed.all_reduce (to trace collectives) sees this one too.
        return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=True)  # type: ignore[no-any-return]


class CollectiveResolver:
    """Finds the collective of a step when the step begins, not when the Accumulator is made:
    one given explicitly (or its group, or the group over a ``DeviceMesh``'s ranks, see
    :mod:`lossweight.parallel`), else the default group if torch.distributed is initialized
    (cached until it changes), else a single process. So an Accumulator made before
    ``init_process_group()``, or restored into a job of another size, reduces over the world
    that exists when its step begins. ``stages``: how many pipeline stages the group's ranks
    are split into, and whether this rank holds the last, which computes the loss."""

    def __init__(
        self,
        group: dist.ProcessGroup | DeviceMesh | None,
        collective: Collective | None,
        pipeline: str | None = None,
    ) -> None:
        if collective is not None and group is not None:
            raise error("group_and_collective", group=group, collective=collective)
        self.parallel: ParallelLayout | None = None
        self.stages, self.pipelined = (1, True), pipeline is not None
        if isinstance(group, DeviceMesh):
            try:  # optional: only for a mesh
                from .parallel import MeshGroup
            except ImportError as missing:
                if missing.name != f"{__package__}.parallel":  # not the file left out
                    raise
                raise error("not_copied", file="parallel.py", use="group= a DeviceMesh") from None
            self.parallel = mesh = MeshGroup(group, pipeline)
            self.stages = mesh.stages
        elif pipeline is not None:
            raise error("pipeline_dimension", value=pipeline, group=group, names=())
        if isinstance(collective, type):
            raise error("collective_class", value=collective, name=collective.__name__)
        if collective is not None and not isinstance(collective, Collective):
            raise error("not_a_collective", value=collective)
        self.explicit = collective is not None or group is not None
        self._group, self._given = group, collective
        self._cached: tuple[weakref.ref[Any], ProcessGroupCollective] | None = None

    def resolve(self) -> Collective:
        """The collective to reduce this step over, its world size checked."""
        collective = self._given if self._given is not None else self._from_torch_distributed()
        size = collective.world_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise error("bad_world_size", collective=collective, value=size)
        return collective

    def _from_torch_distributed(self) -> Collective:
        if not (dist.is_available() and dist.is_initialized()):
            if self._group is not None:
                raise error("no_process_group", group=self._group)
            return _SINGLE_PROCESS
        key = self._group if self._group is not None else dist.group.WORLD
        if self._cached is None or self._cached[0]() is not key:
            group = self.parallel.group() if self.parallel is not None else self._group
            assert not isinstance(group, DeviceMesh)  # a mesh's group is made above
            self._cached = (weakref.ref(key), ProcessGroupCollective(group, self.parallel))
        if (group := self._cached[1].group) is not None:
            try:  # get_backend() raises for a group torch no longer knows
                dist.get_backend(group)
            except (ValueError, TypeError):  # TypeError: torch 2.6
                raise error("group_destroyed", group=self._group) from None
        return self._cached[1]


def parallel_layout(collective: Collective) -> ParallelLayout | None:
    """The parallel layout that ``collective`` reduces over, if any."""
    return collective.parallel if isinstance(collective, ProcessGroupCollective) else None


def start_all_reduce(
    collective: Collective, tensor: torch.Tensor, traceable: bool = False
) -> Waitable | None:
    """``collective.all_reduce_sum(tensor)``, its return value checked. ``traceable``: the
    caller waits on the result in every case, maybe inside a graph torch.compile traces."""
    if traceable and isinstance(collective, ProcessGroupCollective):
        handle = collective.all_reduce_sum(tensor, traceable=True)
    else:
        handle = collective.all_reduce_sum(tensor)
    if handle is not None and not callable(getattr(handle, "wait", None)):
        raise error("bad_handle", collective=type(collective).__name__, value=handle)
    return handle
