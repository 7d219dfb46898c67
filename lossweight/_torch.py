"""Every private or version-dependent torch call lossweight makes, behind one small interface:
when torch changes one of these, this is the file to change."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import TypeVar

import torch
from torch.torch_version import TorchVersion

T = TypeVar("T")
Groups = dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]
# Before torch 2.9, inductor removed _assert_async from compiled graphs, and on ROCm its
# device asserts are compiled out: a compiled check there would pass whatever the ranks sent.
GRAPH_ASSERTS = torch.version.hip is None and TorchVersion(torch.__version__) >= "2.9"


def assert_true(flag: torch.Tensor, message: str) -> None:
    """Fail with ``message`` where ``flag`` is False, without a host read: at once on the CPU
    (RuntimeError), at the next sync on an accelerator, when run in a compiled graph."""
    torch._assert_async(flag, message)


def untraced(message: str, run: Callable[[], T]) -> T:
    """``run()`` outside the graph torch.compile traces: with ``fullgraph=True`` the compile
    fails with ``message``; without it, ``run`` falls back to eager code."""
    torch._dynamo.graph_break(message)
    return torch.compiler.disable(run)()  # type: ignore[no-untyped-call,no-any-return]


def _local(grad: torch.Tensor) -> torch.Tensor:
    """What this rank holds of a gradient: a DTensor's (FSDP2's) local shard."""
    return grad.to_local() if hasattr(grad, "to_local") else grad


def _memory(grad: torch.Tensor) -> object:
    """A key of a gradient's memory; a sparse gradient has no one address, meta memory none."""
    local = _local(grad)
    if local.is_sparse or local.device.type == "meta":
        return id(local)
    return (local.data_ptr(), local.shape, local.stride(), local.device, local.dtype)


def _once(parameters: list[torch.Tensor]) -> dict[object, torch.Tensor]:
    """The parameters with a gradient, by gradient memory: two parameters whose gradient is the
    same memory are rescaled, and clipped, once."""
    found: dict[object, torch.Tensor] = {}
    for parameter in parameters:
        if parameter.grad is not None:
            found.setdefault(_memory(parameter.grad), parameter)
    return found


def gradient_groups(parameters: list[torch.Tensor]) -> Groups:
    """The gradients that exist, each once, by device and dtype for the foreach calls."""
    groups: Groups = defaultdict(list)
    for parameter in _once(parameters).values():
        local = _local(parameter.grad)  # type: ignore[arg-type]
        groups[(local.device, local.dtype)].append(local)
    return groups


def nonzero_gradients(groups: Groups) -> torch.Tensor:
    """Whether a gradient (a sparse one's values) is nonzero: a bool tensor, on an accelerator
    that holds gradients if one does, computed without a host read (meta gradients hold no
    values: they count as zero)."""
    flags = [
        torch.stack(torch._foreach_norm([g._values() if g.is_sparse else g for g in grads])) != 0
        for (device, _), grads in groups.items()
        if device.type != "meta"
    ]
    devices = [flag.device for flag in flags if flag.device.type != "cpu"]
    device = devices[0] if devices else torch.device("cpu")
    none = torch.zeros(0, dtype=torch.bool, device=device)
    return torch.cat([none, *[flag.to(device, non_blocking=True) for flag in flags]]).any()


def check_zero_gradients(parameters: list[torch.Tensor], message: str) -> None:
    """Fail with ``message``, on the device, if a gradient (a sparse one's values) is nonzero."""
    if groups := gradient_groups(parameters):
        assert_true(~nonzero_gradients(groups), message)


def reaches(loss: torch.Tensor, parameters: list[torch.Tensor]) -> bool:
    """Whether ``loss``'s backward reaches a gradient of ``parameters``, one of those tensors
    or a leaf whose gradient is the same memory: a walk of its graph."""
    wanted = {id(p) for p in parameters} | set(_once(parameters))
    nodes, seen = [loss.grad_fn], set()
    while nodes:
        node = nodes.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if (leaf := getattr(node, "variable", None)) is not None and (
            id(leaf) in wanted or (leaf.grad is not None and _memory(leaf.grad) in wanted)
        ):
            return True
        nodes.extend(next_node for next_node, _ in node.next_functions)
    return False


def clip_norm(parameters: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Clip the gradients, each once, to the total norm ``max_norm`` with torch's clipping;
    their norm before (a DTensor's reduced over its mesh: the whole gradient's)."""
    norm = torch.nn.utils.clip_grad_norm_(list(_once(parameters).values()), max_norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def multiply(groups: Groups, factor: torch.Tensor) -> None:
    """Multiply every gradient in place by the 0-dim ``factor``, one pass per group."""
    for (device, _), grads in groups.items():
        torch._foreach_mul_(grads, factor.to(device, non_blocking=True))


class FunctionalAllReduce:
    """Sums ``tensor`` in place with the functional collective, whose wait torch.compile
    traces. ``wait()`` returns the result: read that one, so that a compiled graph orders every
    read after the wait."""

    def __init__(self, tensor: torch.Tensor, group_name: str) -> None:
        torch.ops._c10d_functional.all_reduce_(tensor, "sum", group_name)
        self._tensor = tensor

    def wait(self) -> torch.Tensor:
        waited: torch.Tensor = torch.ops._c10d_functional.wait_tensor(self._tensor)
        return waited


class Verdict:
    """Which checks failed on an accelerator, copied to the host without waiting for it:
    ``ready()`` polls, so that lossweight reports the failure itself at a later call, with no
    host sync on the way."""

    def __init__(self, failed: torch.Tensor) -> None:
        pinned = failed.device.type == "cuda"
        self.failed = torch.empty(failed.shape, dtype=torch.bool, pin_memory=pinned)
        self.failed.copy_(failed, non_blocking=True)
        self._event = torch.Event(failed.device) if failed.device.type != "cpu" else None
        if self._event is not None:
            self._event.record()

    def ready(self, wait: bool = False) -> bool:
        if self._event is not None and wait:
            self._event.synchronize()
        return self._event is None or self._event.query()
