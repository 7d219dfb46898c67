"""Counting the collectives a block of code issues, where they reach torch.distributed."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# The torch.distributed function each communication operator implements. The c10d operators
# are what ProcessGroup calls (torch.distributed's functions, DDP's reducer, FSDP); the
# _c10d_functional ones are the traceable collectives torch.compile and DTensor use, and are
# named after their function already, up to a trailing "_" (in place) or "_out".
_C10D_FUNCTIONS = {
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce_coalesced",
    "allgather_": "all_gather",
    "allgather_coalesced_": "all_gather_coalesced",
    "_allgather_base_": "all_gather_into_tensor",
    "allgather_into_tensor_coalesced_": "all_gather_into_tensor_coalesced",
    "reduce_scatter_": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter_tensor",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter_tensor_coalesced",
    "alltoall_": "all_to_all",
    "alltoall_base_": "all_to_all_single",
    "broadcast_": "broadcast",
    "barrier": "barrier",
    "monitored_barrier_": "monitored_barrier",
    "gather_": "gather",
    "scatter_": "scatter",
    "reduce_": "reduce",
    "send": "send",
    "recv_": "recv",
    "recv_any_source_": "recv",
}
# Operators of those namespaces that move no data between ranks.
_NOT_COLLECTIVES = {"wait_tensor", "check_for_nan", "_wrap_tensor_autograd"}


@dataclass
class CollectiveCounts:
    """What :func:`count_collectives` saw, per torch.distributed function name
    (``"all_reduce"``, ``"all_gather_into_tensor"``, ...)."""

    calls: Counter[str] = field(default_factory=Counter)
    """How many times each collective was issued."""
    bytes: Counter[str] = field(default_factory=Counter)
    """How many bytes of tensors this rank passed to them: its inputs, outputs not counted
    (for an operation in place, such as an all-reduce, the tensor it sums; for ``broadcast``
    off the source rank and for ``recv``, the buffer that is filled)."""


@contextlib.contextmanager
def count_collectives() -> Iterator[CollectiveCounts]:
    """Count the collectives issued inside the ``with`` block, as they reach the process
    group's backend; each one still runs.

    It sees every collective of this thread whatever issued it: ``torch.distributed``'s
    functions, lossweight's reductions, DDP's gradient all-reduce and FSDP's all-gathers and
    reduce-scatters during the backward pass, DTensor's, and functional collectives run in
    eager code. So a test can assert what a training step costs in communication::

        with count_collectives() as seen:
            train_one_step()
        assert seen.calls["all_reduce"] == 1 + ddp_buckets

    Collectives of simulated ranks (:class:`InProcessGroup`) are not ``torch.distributed``
    ones and are not seen. It intercepts every tensor operation of the block (a
    ``TorchDispatchMode``), which slows it down: count in steps that are not timed. torch runs
    no compiled frame under such a mode (``fullgraph=True`` makes that an error): count a
    compiled step's collectives on the same step uncompiled.
    """
    counts = CollectiveCounts()
    with _Counting(counts):
        yield counts


# torch leaves TorchDispatchMode's __init_subclass__ and __init__ unannotated.
class _Counting(TorchDispatchMode):  # type: ignore[no-untyped-call]
    def __init__(self, counts: CollectiveCounts) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._counts = counts

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if any(_dispatches_itself(cls) for cls in types):
            # A tensor subclass (DTensor) dispatches the op itself, issuing its collectives on
            # plain tensors, which come back through this mode to be counted.
            return NotImplemented
        name = _function_name(func)
        if name is not None:
            self._counts.calls[name] += 1
            self._counts.bytes[name] += _input_bytes(func, args, kwargs)
        return func(*args, **kwargs)


def _dispatches_itself(cls: type) -> bool:
    """Whether tensors of ``cls`` handle their ops in their own ``__torch_dispatch__``: not a
    subclass that only adds Python behaviour (``nn.Parameter``, DeepSpeed's parameters)."""
    return (
        issubclass(cls, torch.Tensor)
        and cls.__torch_dispatch__ is not torch.Tensor.__torch_dispatch__
    )


def _function_name(func: torch._ops.OpOverload) -> str | None:
    operator = func._schema.name.split("::")[-1]
    if operator in _NOT_COLLECTIVES:
        return None
    if func.namespace == "c10d":
        return _C10D_FUNCTIONS.get(operator, f"c10d.{operator}")
    if func.namespace == "_c10d_functional":
        return operator.removesuffix("_out").rstrip("_")
    return None


def _input_bytes(func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    given = dict(zip((argument.name for argument in func._schema.arguments), args, strict=False))
    given.update(kwargs)
    return sum(
        _tensor_bytes(value)
        for name, value in given.items()
        if not (name == "out" or name.startswith("output"))
    )


def _tensor_bytes(value: object) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, list | tuple):
        return sum(_tensor_bytes(item) for item in value)
    return 0
