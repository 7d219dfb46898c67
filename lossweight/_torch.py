"""Every private or version-dependent torch call lossweight makes, behind one small interface.

When torch changes one of these, this is the file to change.
"""

from __future__ import annotations

from array import array
from collections import defaultdict
from collections.abc import Callable
from typing import TypeVar

import torch
from torch.torch_version import TorchVersion

# Before torch 2.9, inductor removed _assert_async from compiled graphs, and on ROCm its
# device asserts are compiled out: a compiled check there would pass whatever the ranks sent.
T = TypeVar("T")
GRAPH_ASSERTS = torch.version.hip is None and TorchVersion(torch.__version__) >= "2.9"


def is_compiling() -> bool:
    return torch.compiler.is_compiling()


def untraced(message: str, run: Callable[[], T]) -> T:
    """``run()`` outside any graph torch.compile traces: with ``fullgraph=True`` the compile
    fails with ``message``; without it, ``run`` falls back to eager code."""
    torch._dynamo.graph_break(message)
    return torch.compiler.disable(run)()  # type: ignore[no-untyped-call,no-any-return]


def assert_true(flag: torch.Tensor, message: str) -> None:
    """Fail with ``message`` where ``flag`` is False: at once on the CPU (RuntimeError), at the
    next sync on an accelerator, without a host read either way."""
    torch._assert_async(flag, message)


def float64(values: list[int] | list[float], device: torch.device) -> torch.Tensor:
    """A float64 tensor of host numbers on ``device``, made from a buffer (several times faster
    than from a list) and moved without blocking."""
    host = torch.frombuffer(array("d", values), dtype=torch.float64) if values else torch.zeros(0)
    return host.to(device, torch.float64, non_blocking=True)


def gradient_groups(
    parameters: list[torch.Tensor],
) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    """The parameters' gradients that exist, by device and dtype for the foreach calls. A
    DTensor gradient (FSDP2) is taken through its local shard, all this rank holds."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for parameter in parameters:
        grad = parameter.grad
        if grad is not None:
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            groups[(local.device, local.dtype)].append(local)
    return groups


def all_zero(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Whether every tensor is all zeros, as a bool tensor on their device."""
    return torch.stack(torch._foreach_norm(tensors)).sum() == 0


def multiply(tensors: list[torch.Tensor], factor: torch.Tensor) -> None:
    """Multiply every tensor in place by a 0-dim ``factor`` on their device, in one pass."""
    torch._foreach_mul_(tensors, factor)


def functional_all_reduce(tensor: torch.Tensor, group_name: str) -> torch.Tensor:
    """Start summing ``tensor`` in place with the functional collective, whose wait
    torch.compile traces; return the tensor to wait on."""
    torch.ops._c10d_functional.all_reduce_(tensor, "sum", group_name)
    return tensor


def wait_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The functional collective's result: read this, not the tensor given, so that a compiled
    graph orders every read after the wait."""
    waited: torch.Tensor = torch.ops._c10d_functional.wait_tensor(tensor)
    return waited


class Verdict:
    """Which checks failed, copied to the host without waiting for the device: :meth:`ready`
    polls, so that a failure on an accelerator is reported by lossweight's own message at a
    later call, with no host sync on the way."""

    def __init__(self, failed: torch.Tensor) -> None:
        pinned = failed.device.type == "cuda"
        self.failed = torch.empty(failed.shape, dtype=torch.bool, pin_memory=pinned)
        self.failed.copy_(failed, non_blocking=True)
        self._event = torch.Event(failed.device) if failed.device.type != "cpu" else None
        if self._event is not None:
            self._event.record()

    def ready(self) -> bool:
        return self._event is None or self._event.query()
