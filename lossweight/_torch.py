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


def gradient_groups(parameters: list[torch.Tensor]) -> Groups:
    """The parameters' gradients that exist, by device and dtype for the foreach calls, each
    once: two parameters whose gradient is the same memory are rescaled once. A DTensor
    gradient (FSDP2) is taken through its local shard, all this rank holds."""
    groups: Groups = defaultdict(list)
    seen: set[object] = set()
    for parameter in parameters:
        if (grad := parameter.grad) is not None:
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            # A sparse gradient has no one address; meta memory has none at all.
            key = id(local) if local.is_sparse or local.device.type == "meta" else (
                local.data_ptr(), local.shape, local.stride(), local.device, local.dtype
            )  # fmt: skip
            if key not in seen:
                seen.add(key)
                groups[(local.device, local.dtype)].append(local)
    return groups


def check_zero_gradients(parameters: list[torch.Tensor], message: str) -> None:
    """Fail with ``message`` if a gradient is not all zeros, checked on its device (a sparse
    one by the values it stores)."""
    for grads in gradient_groups(parameters).values():
        dense = [grad._values() if grad.is_sparse else grad for grad in grads]
        assert_true(torch.stack(torch._foreach_norm(dense)).sum() == 0, message)


def reaches(loss: torch.Tensor, parameters: list[torch.Tensor]) -> bool:
    """Whether ``loss``'s backward would accumulate into a gradient of ``parameters``: a walk
    of its autograd graph, to the leaves."""
    wanted, seen = {id(p) for p in parameters}, set()
    nodes = [loss.grad_fn]
    while nodes:
        node = nodes.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if id(getattr(node, "variable", None)) in wanted:
            return True
        nodes.extend(next_node for next_node, _ in node.next_functions)
    return False


def multiply(groups: Groups, factor: torch.Tensor) -> None:
    """Multiply every gradient in place by the 0-dim ``factor``, one pass per group."""
    for (device, _), grads in groups.items():
        torch._foreach_mul_(grads, factor.to(device, non_blocking=True))


def functional_all_reduce(tensor: torch.Tensor, group_name: str) -> torch.Tensor:
    """Start summing ``tensor`` in place with the functional collective, whose wait
    torch.compile traces; return the tensor to wait on."""
    torch.ops._c10d_functional.all_reduce_(tensor, "sum", group_name)
    return tensor


def wait_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The functional collective's result: read this one, so that a compiled graph orders
    every read after the wait."""
    waited: torch.Tensor = torch.ops._c10d_functional.wait_tensor(tensor)
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
