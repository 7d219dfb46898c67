"""A loop without a data-parallel wrapper: each rank sums the ranks' gradients itself, with its
own all-reduce, before ``end()`` (docs/distributed.md, "A rank with no microbatch").

A rank that runs no microbatch then ends its steps holding gradients that its peers' scaled
losses produced. Scaling after, its ``end()`` must accept them and rescale them as every rank
does; a forgotten ``scale_loss()`` is still refused, on every rank together, by the step's one
reduction. Real gloo processes, 2 and 4 ranks, the float64 problem of tests/problem.py against
its single-process full batch.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lossweight import Accumulator

from . import gloo
from .problem import (
    IGNORE,
    make_batch,
    make_model,
    max_relative_error,
    microbatch_loss,
    reference,
    split,
)

# Rows per microbatch per rank: uneven, an empty microbatch, and the last rank with none at all.
# With 4 ranks, rank 1's rows are all padding when weighting by tokens.
SIZES = {2: [[3, 0, 2], []], 4: [[2, 0, 3], [2], [1, 1, 1, 1], []]}
STEPS = 4  # scale after, count first, scale after, count first: one Accumulator throughout
ROUND_OFF = 1e-12


def _sum_gradients(parameters: Iterable[torch.Tensor]) -> None:
    """The loop's own gradient reduction: every rank's gradients summed, on every rank."""
    for parameter in parameters:
        if parameter.grad is None:
            parameter.grad = torch.zeros_like(parameter)
        dist.all_reduce(parameter.grad)


def _step_errors(rank: int, world_size: int, weight_by: str, loss_reduction: str) -> list[dict]:
    """STEPS steps of one Accumulator, modes alternating; per step, the gradient's relative
    error and the logged loss's error against the full batch, and the step's count."""
    acc = Accumulator(loss_reduction=loss_reduction, weight_by=weight_by, grad_reduction="sum")  # type: ignore[arg-type]
    sizes, records = SIZES[world_size], []
    for step in range(STEPS):
        seed = 40 + step
        rows = sum(map(sum, sizes))
        lengths = torch.randint(1, 9, (rows,), generator=torch.Generator().manual_seed(seed))
        batch = make_batch(lengths.tolist(), max_length=8, seed=seed, left_padding=step % 2 == 1)
        shares = split(rows, [sum(share) for share in sizes])
        if weight_by == "tokens" and world_size == 4:
            batch.labels[shares[1][0] : shares[1][1]] = IGNORE
        model = make_model(seed)
        expected_loss, expected = reference(model, batch, weight_by)
        start = shares[rank][0]
        bounds = split(shares[rank][1] - start, sizes[rank])
        microbatches = [batch.rows(start + a, start + b) for a, b in bounds]
        scale_after = step % 2 == 0
        if scale_after:
            acc.begin(parameters=model.parameters())
        else:
            acc.begin(
                num_samples=[mb.num_samples for mb in microbatches],
                num_tokens=[int(mb.num_tokens) for mb in microbatches],
            )
        for mb in microbatches:
            loss = microbatch_loss(model, mb, weight_by, loss_reduction)
            counts = {"num_samples": mb.num_samples, "num_tokens": int(mb.num_tokens)}
            acc.scale_loss(loss, **(counts if scale_after else {})).backward()
        _sum_gradients(model.parameters())
        result = acc.end()
        grads = [p.grad for p in model.parameters()]
        records.append(
            {
                "mode": "scale after" if scale_after else "count first",
                "grad_error": max_relative_error(grads, expected),  # type: ignore[arg-type]
                "loss_error": abs(result.loss.item() - expected_loss),
                "count": int(getattr(result, f"num_{weight_by}")),
                "expected_count": int(
                    batch.num_tokens if weight_by == "tokens" else batch.num_samples
                ),
            }
        )
    return records


def _refusal(rank: int, world_size: int, case: str) -> dict[str, Any]:
    """A scale-after step refused at end(), then abandon() everywhere and one good step on the
    same Accumulator: what each rank raised, and whether the next step was exact."""
    acc = Accumulator(loss_reduction="sum", grad_reduction="sum")
    x = torch.tensor(2.0, dtype=torch.float64, requires_grad=True)
    elsewhere = torch.zeros((), dtype=torch.float64, requires_grad=True)
    if case == "forgotten_everywhere":
        acc.begin(parameters=[x])
        (x * 3.0).backward()  # scale_loss() forgotten on every rank
    elif case.startswith("forgotten_on_rank_1"):  # rank 0 scales its loss, rank 1 forgets to
        acc.begin(parameters=[x])
        loss = x * 3.0
        (acc.scale_loss(loss, num_tokens=3) if rank == 0 else loss).backward()
        if case.endswith("summed"):  # the loop sums the gradients before end(): all the same
            _sum_gradients([x])
    else:  # rank 0's losses reach none of the parameters it gave begin()
        acc.begin(parameters=[elsewhere] if rank == 0 else [x])
        acc.scale_loss(x * 3.0, num_tokens=3).backward()
        x.grad = None if rank == 0 else x.grad
    try:
        acc.end()
        raised: dict[str, Any] = {"error": None}
    except Exception as error:  # what each rank raised is the outcome
        raised = {"error": type(error).__name__, "message": str(error)}
    acc.abandon()
    x.grad = elsewhere.grad = None
    acc.begin(parameters=[x])  # then a good step: rank r's loss (r + 1) x over r + 1 tokens
    acc.scale_loss(x * (rank + 1.0), num_tokens=rank + 1).backward()
    _sum_gradients([x])
    result = acc.end()
    assert x.grad is not None
    raised["next_grad"], raised["next_tokens"] = x.grad.item(), int(result.num_tokens)
    return raised


def run(rank: int, world_size: int) -> dict[str, Any]:
    steps = {
        f"{weight_by}/{loss_reduction}": _step_errors(rank, world_size, weight_by, loss_reduction)
        for weight_by in ("tokens", "samples")
        for loss_reduction in ("mean", "sum")
    }
    cases = ("forgotten_everywhere", "forgotten_on_rank_1", "forgotten_on_rank_1_summed")
    cases += ("no_gradients",)
    refusals = {case: _refusal(rank, world_size, case) for case in cases}
    return {"steps": steps, "refusals": refusals}


@pytest.fixture(scope="module", params=[2, 4], ids=["2 ranks", "4 ranks"])
def ranks(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return gloo.values(gloo.run_ranks(request.param, run, deadline=90))


def test_a_rank_with_no_microbatch_takes_its_peers_gradients(ranks: list[dict]) -> None:
    # Every configuration, every step, on every rank (the last one ran no microbatch): the
    # full batch's gradient and loss to round-off, and its count exactly.
    for rank, outcome in enumerate(ranks):
        for name, records in outcome["steps"].items():
            assert [r["mode"] for r in records] == ["scale after", "count first"] * 2
            for step, record in enumerate(records):
                where = f"rank {rank}, {name}, step {step} ({record['mode']})"
                assert record["grad_error"] < ROUND_OFF, (where, record)
                assert record["loss_error"] < ROUND_OFF, (where, record)
                assert record["count"] == record["expected_count"] > 0, (where, record)


@pytest.mark.parametrize(
    "case", ["forgotten_everywhere", "forgotten_on_rank_1", "forgotten_on_rank_1_summed"]
)
def test_a_forgotten_scale_loss_is_refused_on_every_rank(ranks: list[dict], case: str) -> None:
    # On every rank, or on one while the others scale theirs, its gradients the rank's own or
    # summed with the others' before end() (where every rank then holds the same gradients):
    # the backward on a rank that scaled no loss is seen, and refused on every rank.
    for rank, outcome in enumerate(ranks):
        refused = outcome["refusals"][case]
        assert refused["error"] == "RuntimeError", (rank, refused)
        assert "found nonzero gradients that no scale_loss() produced" in refused["message"]


def test_a_refusal_on_one_rank_reaches_every_rank(ranks: list[dict]) -> None:
    # Rank 0 refuses (its losses reached none of its parameters); the others are told by the
    # same reduction, instead of waiting in it until the process group's timeout.
    world_size = len(ranks)
    own = ranks[0]["refusals"]["no_gradients"]
    assert own["error"] == "ValueError", own
    assert "none of the 1 parameters given to begin() has a gradient" in own["message"]
    for rank in range(1, world_size):
        told = ranks[rank]["refusals"]["no_gradients"]
        assert told["error"] == "RuntimeError", (rank, told)
        assert f"1 of the {world_size} ranks of the reduction refused" in told["message"]


def test_the_step_after_a_refusal_is_exact(ranks: list[dict]) -> None:
    # After abandon() on every rank: rank r's summed loss (r + 1) x over r + 1 tokens, so the
    # step's token mean is x and its gradient 1 on every rank.
    world_size = len(ranks)
    for outcome in ranks:
        for refused in outcome["refusals"].values():
            assert refused["next_grad"] == pytest.approx(1.0, rel=1e-15)
            assert refused["next_tokens"] == world_size * (world_size + 1) // 2
