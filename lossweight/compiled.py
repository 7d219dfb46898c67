"""torch.compile support: a count-first ``scale_loss()`` traced into a compiled graph.

A compiled microbatch function that calls ``scale_loss()`` compiles one graph however many
microbatches a step has: the step counts its microbatches in a tensor on the device, a cursor
(dynamo specialises a Python int, and would compile a graph per microbatch); each microbatch's
factor and loss are taken at the cursor's position, the ranks' agreement is checked by asserts
kept in the graph, and ``begin()``'s all-reduce is the functional one, whose wait a graph
traces. The core imports this module where it exists: a vendorer who never compiles
``scale_loss()`` leaves it out (docs/vendoring.md), and a copy without it refuses a compiled
``scale_loss()`` by name. Every torch call that only compiling needs is here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch.torch_version import TorchVersion

from .errors import add_messages, device_message
from .terms import ARGUMENTS, COUNTS, FIELDS, TOO_LARGE

if TYPE_CHECKING:
    from .steps import CountFirst

# The rows of this module's errors, added to lossweight.errors.MESSAGES when it is imported.
# fmt: off
_MESSAGES: dict[str, tuple[type[Exception], str]] = {
    "traced_too_many": (RuntimeError, "lossweight: a compiled scale_loss() was called for more microbatches than begin() declared; declare one count per microbatch in begin()"),
    "traced_too_few": (RuntimeError, "lossweight: end() was called before every microbatch that begin() declared went through scale_loss(); pass every declared microbatch's loss through scale_loss(), or declare fewer"),
    "graph_asserts": (RuntimeError, "lossweight: scale_loss() inside torch.compile needs torch 2.9 or newer on CPU or CUDA (this is torch {version}), whose compiled graphs keep the asserts of the ranks' agreement check; upgrade torch, or call scale_loss() outside the compiled function"),
}
# fmt: on
add_messages(_MESSAGES)

T = TypeVar("T")
# Before torch 2.9, inductor removed _assert_async from compiled graphs, and on ROCm its
# device asserts are compiled out: a compiled check there would pass whatever the ranks sent.
GRAPH_ASSERTS = torch.version.hip is None and TorchVersion(torch.__version__) >= "2.9"
# torch 2.7 gave torch._dynamo.graph_break its message argument.
GRAPH_BREAK_MESSAGE = TorchVersion(torch.__version__) >= "2.7"
# The words of the agreement check's asserts, fixed, so that a graph neither formats a string
# per reduction nor reads a number that torch.compile may have made symbolic.
ASSERT_MESSAGES = (
    *[device_message("disagree", field=field) for field in FIELDS * 2],  # codes, their squares
    device_message("unscaled_gradients"),
    device_message("peer_refused", count="some", ranks="several"),
    *[device_message("total_too_large", name=ARGUMENTS[c], fix=TOO_LARGE[c]) for c in COUNTS],
)


def scale(step: CountFirst, losses: Sequence[torch.Tensor], start: int) -> torch.Tensor:
    """``step.scale()`` as torch.compile traces it: the position is a tensor, and nothing in the
    graph depends on the counts or on how many microbatches came before (``start`` eager ones,
    where the first compiled microbatch makes the cursor)."""
    if step.cursor is None:
        step.cursor = torch.full((), start, dtype=torch.int64, device=losses[0].device)
    cursor, buffers = step.cursor, step.buffers(losses[0])
    # Sizes come from shapes, which torch.compile makes symbolic, never from step.size, a
    # Python int it would compile one graph for each value of; the position is clamped so
    # that the assert, not an index out of bounds, reports a microbatch too many.
    size = buffers[0].shape[0]
    torch._assert_async(cursor < size, device_message("traced_too_many"))
    position = cursor.clamp(max=size - 1).view(1)
    scaled = []
    for term, (loss, buffer) in enumerate(zip(losses, buffers, strict=True)):
        buffer.index_copy_(0, position, loss.detach().to(torch.float64).view(1))
        factors, positive = step.cast(loss)
        selected = positive[term].index_select(0, position).view(())
        factor = factors[term].index_select(0, position).view(())
        scaled.append(torch.where(selected, loss, 0.0) * factor)
    cursor.add_(1)
    return sum(scaled[1:], scaled[0])


def all_taken(cursor: torch.Tensor, size: int) -> None:
    """At ``end()``, that every declared microbatch came through: on the device, no host sync."""
    torch._assert_async(cursor == size, device_message("traced_too_few"))


def check(checked: torch.Tensor, extra: Sequence[str], on_host: Callable[[], None]) -> None:
    """The ranks' agreement check of a reduction used in a graph: an assert per slot, worded
    by ``ASSERT_MESSAGES`` and then ``extra``, a parallel layout's; where graphs drop
    asserts, ``on_host`` outside the graph, or a failed compile under ``fullgraph=True``."""
    if not GRAPH_ASSERTS:
        untraced(device_message("graph_asserts", version=torch.__version__), on_host)
        return
    messages = (*ASSERT_MESSAGES, *extra)
    for index, passed in enumerate(checked):
        torch._assert_async(passed, messages[index])


def untraced(message: str, run: Callable[[], T]) -> T:
    """``run()`` outside the graph torch.compile traces: with ``fullgraph=True`` the compile
    fails with ``message``; without it, ``run`` falls back to eager code."""
    graph_break(message)
    return torch.compiler.disable(run)()  # type: ignore[no-untyped-call,no-any-return]


def graph_break(message: str) -> None:
    """``torch._dynamo.graph_break(message)``. torch 2.6's takes no message: the break is made
    where dynamo traces this call, with the message (later torch made unimplemented()'s
    arguments keywords)."""
    if GRAPH_BREAK_MESSAGE:
        torch._dynamo.graph_break(message)
    else:
        from torch._dynamo.comptime import comptime

        def fail(context: Any) -> None:  # run by dynamo as it traces; reads no free variable
            text = context.get_local("message").as_python_constant()
            torch._dynamo.exc.unimplemented(text)  # type: ignore[call-arg]

        comptime(fail)


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
