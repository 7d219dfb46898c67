"""What each gloo process of tests/test_fsdp_given.py runs: scale-after steps of a model sharded
with FSDP2 (``fully_shard``, on CPU), given to ``begin()`` whole, in part, or while unsharded.

The model: two linear layers in float64, the first sharded on its own and the second by the
root, so that the optimizer's two param groups are two FSDP2 parameter groups. Each case runs
two steps of two microbatches (rank r: 1 + r + s rows in step s, then 2), each loss the sum of
the outputs, weighted by its rows, so that the second step's estimate of W (the first step's)
is not its W either. A step returns what it did: "ended" with the largest relative error of
the sharded gradients against a count-first step of the same data (0 to round-off where it is
exact), or the type and message of what ``end()`` raised.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from lossweight import Accumulator, _torch

F64, F32 = torch.float64, torch.float32


def _model(world_size: int, **options: Any) -> tuple[torch.nn.Sequential, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    model = model.to(F64)
    mesh = init_device_mesh("cpu", (world_size,))
    fully_shard(model[0], mesh=mesh, **options)
    fully_shard(model, mesh=mesh, **options)
    groups = [{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 0.1}]
    return model, torch.optim.SGD(groups, lr=1.0)


def _microbatches(rank: int, step: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(10 * step + rank)
    return [torch.randn(rows, 3, dtype=F64, generator=generator) for rows in (1 + rank + step, 2)]


def _sharded(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The sharded parameters, where FSDP2 puts the gradients even while a module is unsharded
    (and model.parameters() returns the unsharded ones)."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def _gradients(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    grads = []
    for p in _sharded(optimizer):
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        grads.append(grad.full_tensor() if hasattr(grad, "full_tensor") else grad)
    return grads


def _expected(rank: int, world_size: int) -> list[list[torch.Tensor]]:
    """Each step's gradients, counting first: the exact ones."""
    model, optimizer = _model(world_size)
    acc = Accumulator(weight_by="samples", loss_reduction="sum")
    steps = []
    for step in range(2):
        optimizer.zero_grad()
        microbatches = _microbatches(rank, step)
        acc.begin(num_samples=[len(x) for x in microbatches])
        for x in microbatches:
            acc.scale_loss(model(x).sum()).backward()
        acc.end()
        steps.append(_gradients(optimizer))
    return steps


def _step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    acc: Accumulator,
    rank: int,
    step: int,
    parameters: object,
) -> str:
    """One scale-after step over ``parameters``; what it did."""
    acc.begin(parameters=parameters)
    for x in _microbatches(rank, step):
        acc.scale_loss(model(x).sum(), num_samples=len(x)).backward()
    try:
        acc.end()
    except (ValueError, RuntimeError) as refused:
        acc.abandon()
        return f"{type(refused).__name__}: {refused}"
    return "ended"


def _given(
    case: str, rank: int, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> object:
    """What ``case`` gives begin() on ``rank`` in ``step``, the modules unsharded as it says."""
    if case.endswith("one_group") or (case == "one_group_on_rank_0" and rank == 0):
        return optimizer.param_groups[0]["params"]
    if case == "some_parameters":
        return [model[0].weight, model[2].bias]
    if case == "parameters":
        return model.parameters()
    if case.startswith("root_unsharded") and (step == 1 or not case.endswith("later")):
        model.unshard()  # type: ignore[operator] (the root's parameter group only)
    if case == "all_unsharded":
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.unshard()
    return optimizer if case.endswith("optimizer") or case == "one_group_on_rank_0" else model


# Each case: the options of fully_shard.
CASES: dict[str, dict[str, Any]] = {
    # Every parameter, sharded: exact.
    "model": {},
    "optimizer": {},
    "parameters": {},
    # Part of them: one param group (on every rank, or on rank 0 alone), or two parameters.
    "one_group": {},
    "one_group_on_rank_0": {},
    "some_parameters": {},
    # One param group, the gradients zeroed as zeros: the left-out group's exist when its
    # losses are scaled, and FSDP2 adds to their local shards in place.
    "zeroed_one_group": {},
    # The model given while unsharded: its root (model.unshard() is not recursive), every
    # FSDP2 module, the root in the second step only; and the optimizer then, which is exact.
    "root_unsharded": {},
    "all_unsharded": {},
    "root_unsharded_later": {},
    "root_unsharded_optimizer": {},
    # Kept unsharded after the backward: the second step's begin() finds it unsharded.
    "kept_unsharded": {"reshard_after_forward": False},
    "kept_unsharded_optimizer": {"reshard_after_forward": False},
    # Computed in float32 (the unsharded parameters are float32 copies), reduced in float64.
    "mixed_precision": {"mp_policy": MixedPrecisionPolicy(F32, F64)},
    "mixed_precision_one_group": {"mp_policy": MixedPrecisionPolicy(F32, F64)},
    # A torch whose FSDP2 keeps its parameters where lossweight does not look: not checked,
    # and never refused for that (the gradients of a param group left out are left unscaled).
    "moved_one_group": {},
    "moved_model": {},
}


def case_outcome(rank: int, world_size: int, case: str) -> list[str]:
    """Two steps of ``case``, the gradients zeroed before each: what each did."""
    model, optimizer = _model(world_size, **CASES[case])
    if case.startswith("kept_unsharded"):
        model.set_reshard_after_backward(False)
    expected = _expected(rank, world_size)
    acc = Accumulator(weight_by="samples", loss_reduction="sum")
    outcomes = []
    for step in range(2):
        optimizer.zero_grad(set_to_none=not case.startswith("zeroed"))
        given = _given(case, rank, step, model, optimizer)
        outcome = _step(model, optimizer, acc, rank, step, given)
        if outcome == "ended":
            got = _gradients(optimizer)
            error = max(
                float((g - e).abs().max() / e.abs().max())
                for g, e in zip(got, expected[step], strict=True)
            )
            outcome = f"ended, max relative error {error:.1e}"
        outcomes.append(outcome)
    return outcomes


def held_after_abandon(rank: int, world_size: int, mixed: bool) -> list[str]:
    """A scale-after step abandoned after a backward with gradient sync off, the gradients
    zeroed: what begin() then does, before and after the recovery of docs/resume.md (a zero
    loss back-propagated with gradient sync on, then zero_grad()). ``mixed``: FSDP2 reduces
    in float64 a model computed in float32, keeping what it holds at that dtype."""
    policy = MixedPrecisionPolicy(param_dtype=F32, reduce_dtype=F64)
    model, optimizer = _model(world_size, **({"mp_policy": policy} if mixed else {}))
    acc, x, outcomes = Accumulator(loss_reduction="sum"), _microbatches(rank, 0)[0], []
    try:
        with acc.begin(parameters=optimizer):
            model.set_requires_gradient_sync(False)  # type: ignore[operator]
            acc.scale_loss(model(x).sum(), num_tokens=len(x)).backward()
            raise MemoryError("the next microbatch did not fit")
    except MemoryError:
        optimizer.zero_grad()
    for recovered in (False, True):
        if recovered:
            model.set_requires_gradient_sync(True)  # type: ignore[operator]
            (model(x).sum() * 0).backward()
            optimizer.zero_grad()
        try:
            acc.begin(parameters=optimizer)
            outcomes.append("began")
            acc.abandon()
        except RuntimeError as error:
            outcomes.append(f"{type(error).__name__}: {error}")
    return outcomes


def _not_found() -> None:
    return None


def run(rank: int, world_size: int) -> dict[str, list[str]]:
    outcomes = {}
    found = _torch.fsdp_shards
    for case in CASES:
        if case.startswith("moved"):  # as if this torch kept them elsewhere
            _torch.fsdp_shards = _not_found  # type: ignore[assignment]
        try:
            outcomes[case] = case_outcome(rank, world_size, case)
        finally:
            _torch.fsdp_shards = found  # type: ignore[assignment]
    for mixed in (False, True):
        outcomes[f"held_after_abandon/{mixed}"] = held_after_abandon(rank, world_size, mixed)
    return outcomes
