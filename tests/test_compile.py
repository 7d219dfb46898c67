"""torch.compile of a count-first microbatch function, in one process: what its graph checks.

The compiled loop on real gloo ranks (gradients, graph breaks, recompiles, and ranks that
disagree) is in tests/test_integrations.py; these are the checks one process can provoke: a
step total of 2**62 tokens fails inside the graph, and on a torch whose compiled graphs would
drop the agreement check's asserts, compiling scale_loss() is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from lossweight import Accumulator, DisagreementError, _payload

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


def test_a_step_total_of_2_62_fails_inside_the_graph() -> None:
    acc = Accumulator(loss_reduction="sum")
    microbatch, layer = compiled(acc)
    features = torch.ones(2, 4)
    acc.begin(num_tokens=[2**61, 2**61])  # each count is fine, their total is not
    with pytest.raises(RuntimeError, match=r"total num_tokens over all ranks is 2\*\*62 or more"):
        microbatch(features)
    acc.abandon()
    # The graph raised before it could record the failure, so the next call that settles the
    # step reports it, as a DisagreementError, once; then steps go on.
    with pytest.raises(DisagreementError, match=r"total num_tokens of the step .* 2\*\*62"):
        acc.begin(num_tokens=[3])
    acc.begin(num_tokens=[3])  # the same graph serves the next step, which checks out
    scaled = microbatch(features)
    acc.end()
    torch.testing.assert_close(scaled, layer(features).sum() / 3)


def test_compiling_scale_loss_is_refused_where_graphs_drop_asserts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # As on torch < 2.9 (inductor removed _assert_async) or ROCm (device asserts compiled out).
    monkeypatch.setattr(_payload, "_GRAPH_ASSERTS", False)
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
    with pytest.raises(DisagreementError, match=r"2\*\*62 or more"):
        microbatch(features)
    acc.abandon()
