"""torch.compile of a count-first microbatch function, in one process: what its graph checks.

The compiled loop on real gloo ranks (gradients, graph breaks, recompiles, and ranks that
disagree) is in tests/test_integrations.py; these are the checks one process can provoke: a
step total of 2**62 tokens fails inside the graph, and on a torch whose compiled graphs would
drop the agreement check's asserts, compiling scale_loss() is refused.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch._dynamo.testing
from torch.utils._python_dispatch import TorchDispatchMode

import lossweight.compiled
from lossweight import Accumulator

from .torch_range import needs_compiled_checks

Microbatch = Callable[[torch.Tensor], torch.Tensor]


def compiled(acc: Accumulator, fullgraph: bool = True) -> tuple[Microbatch, torch.nn.Module]:
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 1)

    def microbatch(features: torch.Tensor) -> torch.Tensor:
        return acc.scale_loss(layer(features).sum())

    return torch.compile(microbatch, fullgraph=fullgraph), layer


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@needs_compiled_checks
def test_a_step_total_of_2_62_fails_inside_the_graph() -> None:
    acc = Accumulator(loss_reduction="sum")
    microbatch, layer = compiled(acc)
    features = torch.ones(2, 4)
    acc.begin(num_tokens=[2**61, 2**61])  # each count is fine, their total is not
    with pytest.raises(RuntimeError, match=r"total num_tokens over all ranks is 2\*\*62 or more"):
        microbatch(features)
    acc.abandon()
    # The graph raised before it could record the failure, so the next call that settles the
    # step reports it, as a ValueError, once; then steps go on.
    with pytest.raises(ValueError, match=r"total num_tokens over all ranks is 2\*\*62 or more"):
        acc.begin(num_tokens=[3])
    acc.begin(num_tokens=[3])  # the same graph serves the next step, which checks out
    scaled = microbatch(features)
    acc.end()
    torch.testing.assert_close(scaled, layer(features).sum() / 3)


def test_compiling_scale_loss_is_refused_where_graphs_drop_asserts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # As on torch < 2.9 (inductor removed _assert_async) or ROCm (device asserts compiled out).
    monkeypatch.setattr(lossweight.compiled, "GRAPH_ASSERTS", False)
    acc = Accumulator(loss_reduction="sum")
    microbatch, _ = compiled(acc)
    acc.begin(num_tokens=[3])
    with pytest.raises(Exception, match=r"scale_loss\(\) inside torch.compile needs torch 2.9"):
        microbatch(torch.ones(2, 4))
    acc.abandon()
    # Without fullgraph, dynamo falls back to eager code there, which checks on the host.
    microbatch, layer = compiled(acc, fullgraph=False)
    features = torch.ones(2, 4)
    acc.begin(num_tokens=[3])
    scaled = microbatch(features)
    acc.end()
    torch.testing.assert_close(scaled, layer(features).sum() / 3)
    acc.begin(num_tokens=[2**61, 2**61])
    with pytest.raises(ValueError, match=r"2\*\*62 or more"):
        microbatch(features)
    acc.abandon()


# An Accumulator at module level, as a training script keeps it: dynamo specializes the Python
# ints it reaches through a global, so nothing in the graph may count microbatches in one.
GLOBAL_ACC = Accumulator(loss_reduction="mean")


@needs_compiled_checks
def test_ten_microbatches_of_a_global_accumulator_compile_two_graphs() -> None:
    import torch._dynamo.testing

    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 1, dtype=torch.float64)
    counter = torch._dynamo.testing.CompileCounter()

    @torch.compile(fullgraph=True, backend=counter)
    def microbatch(features: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        # The mean over the rows of the mask, NaN for the microbatch without any (whose
        # backward stays finite, as cross_entropy's over no target does not).
        rows = mask.sum()
        mean = (layer(features).squeeze(-1) * mask).sum() / rows.clamp(min=1)
        return GLOBAL_ACC.scale_loss(torch.where(rows > 0, mean, torch.nan))

    tokens = list(range(10))  # rows that count, per microbatch of 9 rows
    masks = [(torch.arange(9) < n).double() for n in tokens]
    for _ in range(2):
        features = [torch.randn(9, 4, dtype=torch.float64) for _ in tokens]
        GLOBAL_ACC.begin(num_tokens=tokens)
        for rows, mask in zip(features, masks, strict=True):
            microbatch(rows, mask).backward()
        GLOBAL_ACC.end()
        # The token mean over the whole step, in one piece.
        total = sum((layer(x).squeeze(-1) * m).sum() for x, m in zip(features, masks, strict=True))
        expected = torch.autograd.grad(total / sum(tokens), list(layer.parameters()))
        for parameter, grad in zip(layer.parameters(), expected, strict=True):
            torch.testing.assert_close(parameter.grad, grad)
            parameter.grad = None
    assert counter.frame_count == 2  # a step's first microbatch, and every other one


@needs_compiled_checks
def test_a_step_may_mix_eager_and_compiled_microbatches() -> None:
    acc = Accumulator(loss_reduction="sum")
    microbatch, layer = compiled(acc)
    features = torch.ones(2, 4)
    # Eager first, then compiled: the compiled calls count on from the eager ones.
    acc.begin(num_tokens=[1, 1, 2])
    eager = acc.scale_loss(layer(features).sum())
    after = [microbatch(features), microbatch(features)]
    result = acc.end()
    for scaled in (eager, *after):
        torch.testing.assert_close(scaled, layer(features).sum() / 4)
    assert result.num_tokens.item() == 4
    assert result.loss.item() == pytest.approx(3 * layer(features).sum().item() / 4, rel=1e-6)
    # Compiled first, then eager (as when dynamo falls back): the eager call takes the next
    # position, and the step checks out.
    acc.begin(num_tokens=[1, 3])
    first = microbatch(features)
    second = acc.scale_loss(layer(features).sum())
    acc.end()
    torch.testing.assert_close(first, layer(features).sum() / 4)
    torch.testing.assert_close(second, layer(features).sum() / 4)
    # Too few compiled microbatches: end() refuses the step.
    acc.begin(num_tokens=[1, 3])
    microbatch(features)
    with pytest.raises(RuntimeError, match="end\\(\\) was called before every microbatch"):
        acc.end()
    acc.abandon()


class HostReads(TorchDispatchMode):
    """Counts the reads of a tensor's value by the host (``.item()``, ``int(t)``, ``bool(t)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.reads += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


@needs_compiled_checks
def test_an_eager_call_in_a_compiled_step_reads_its_position_once() -> None:
    # Where dynamo falls back, the eager call reads the device's cursor: once (it read it
    # twice, with a bool() of the tensor first), and backward_scale() alike.
    acc = Accumulator(loss_reduction="sum")
    microbatch, layer = compiled(acc)
    features = torch.ones(2, 4)
    acc.begin(num_tokens=[1, 2, 1])
    microbatch(features)
    loss = layer(features).sum()
    with HostReads() as reads:
        acc.backward_scale()
    assert reads.reads == 1
    with HostReads() as reads:
        acc.scale_loss(loss)
    assert reads.reads == 1
    microbatch(features)
    acc.end()


@needs_compiled_checks
def test_the_graphs_do_not_grow_with_the_number_of_microbatches() -> None:
    # Steps of 1 to 12 microbatches in a row, each size new: the graphs of the first sizes
    # (5 here, with the sizes of the token tensors also new) serve every later one, since
    # sizes become symbolic: below dynamo's recompile limit (8), and every gradient is eager's.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 1)).double()
    eager_model = copy.deepcopy(model)
    acc, eager_acc = Accumulator(loss_reduction="sum"), Accumulator(loss_reduction="sum")
    counter = torch._dynamo.testing.CompileCounter()

    @torch.compile(backend=counter, fullgraph=True)
    def microbatch(tokens: torch.Tensor) -> torch.Tensor:
        return acc.scale_loss(model(tokens).sum())

    graphs = []
    for size in range(1, 13):
        counts = [1 + (3 * k) % 5 for k in range(size)]
        acc.begin(num_tokens=counts)
        eager_acc.begin(num_tokens=counts)
        for count in counts:
            tokens = torch.arange(count) % 10
            microbatch(tokens).backward()
            eager_acc.scale_loss(eager_model(tokens).sum()).backward()
        acc.end()
        eager_acc.end()
        for compiled_p, eager_p in zip(model.parameters(), eager_model.parameters(), strict=True):
            torch.testing.assert_close(compiled_p.grad, eager_p.grad)
            compiled_p.grad, eager_p.grad = None, None
        graphs.append(counter.frame_count)
    print("graphs after each step size 1..12:", graphs)
    assert graphs[5:] == [graphs[5]] * 7 and graphs[-1] <= 6, graphs


@needs_compiled_checks
def test_a_microbatch_too_many_of_a_real_model_gets_lossweight_s_message() -> None:
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 1)).double()
    acc = Accumulator(loss_reduction="sum")

    @torch.compile(fullgraph=True)
    def microbatch(tokens: torch.Tensor) -> torch.Tensor:
        return acc.scale_loss(model(tokens).sum())

    acc.begin(num_tokens=[2])
    microbatch(torch.arange(2)).backward()
    with pytest.raises(RuntimeError, match="a compiled scale_loss\\(\\) was called for more"):
        microbatch(torch.arange(2))
    acc.abandon()


@needs_compiled_checks
def test_factors_read_in_eager_code_keep_a_compiled_step_s_loss() -> None:
    # A compiled step takes every microbatch through scale_loss(), counted on the device: its
    # factor reads take none, and its logged loss is known.
    acc = Accumulator(loss_reduction="sum")
    microbatch, layer = compiled(acc)
    features = torch.ones(2, 4)
    acc.begin(num_tokens=[3, 1])
    for index in range(2):
        acc.backward_scale(index)
        microbatch(features).backward()
    result = acc.end()
    torch.testing.assert_close(result.loss, (2 * layer(features).sum() / 4).double())
