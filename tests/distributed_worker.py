"""What each process of the multi-process tests runs (see test_distributed.py).

Every rank builds the same global batch and the same model, runs one optimizer step on its own
share of the rows under a real data-parallel wrapper (DDP or FSDP2) over a gloo process group
(started by tests/gloo.py), compares its gradients with the single-process full-batch
reference, and returns what it saw, as JSON-able values, for the test process to check.
"""

from __future__ import annotations

import contextlib
import copy

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from lossweight import Accumulator
from lossweight.testing import count_collectives

from . import terms_problem
from .problem import (
    IGNORE,
    Batch,
    make_batch,
    make_model,
    max_relative_error,
    microbatch_loss,
    reference,
    split,
)
from .torch_range import FSDP2_ON_CPU


def layout(world_size: int, weight_by: str) -> list[list[int]]:
    """Rows per microbatch per rank: uneven, with an empty microbatch, and rank 1 holding no
    weight (all-padding rows when weighting by tokens, no rows when weighting by samples)."""
    zero_weight_rank = [2] if weight_by == "tokens" else [0]
    if world_size == 2:
        return [[3, 0, 2], zero_weight_rank]
    return [[2, 0, 3], zero_weight_rank, [2, 2], [1, 1, 1, 1]]


def global_batch(world_size: int, weight_by: str, seed: int) -> tuple[Batch, list[list[int]]]:
    sizes = layout(world_size, weight_by)
    rows = sum(map(sum, sizes))
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 9, (rows,), generator=generator).tolist()
    batch = make_batch(lengths, max_length=8, seed=seed, left_padding=bool(seed % 2))
    if weight_by == "tokens":
        start, stop = split(rows, [sum(s) for s in sizes])[1]
        batch.labels[start:stop] = IGNORE
    return batch, sizes


def wrap(model: torch.nn.Module, wrapper: str, world_size: int, grad_reduction: str):
    if wrapper == "ddp":
        return DistributedDataParallel(model)
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if grad_reduction == "sum":  # sum the ranks' gradients instead of averaging them
        for module in (model[0], model[2], model):
            module.set_gradient_divide_factor(1.0)
    return model


def microbatch_context(model: torch.nn.Module, wrapper: str, last: bool):
    """Skip the gradient reduction on all but the last microbatch of the step."""
    if wrapper == "ddp":
        return contextlib.nullcontext() if last else model.no_sync()
    model.set_requires_gradient_sync(last)
    return contextlib.nullcontext()


def full_gradients(model: torch.nn.Module) -> list[torch.Tensor]:
    grads = []
    for p in model.parameters():
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        grads.append(grad.full_tensor() if hasattr(grad, "full_tensor") else grad)
    return grads


def run_step(
    model, wrapper, microbatches, weight_by, loss_reduction, acc=None, scale_after=False, clip=None
):
    """One step; with ``acc`` None, the plain ``loss / accumulation_steps`` of most loops;
    ``clip``: a scale-after step's ``end(max_grad_norm=clip)``."""
    if acc is not None and not scale_after:
        acc.begin(
            num_samples=[mb.num_samples for mb in microbatches],
            num_tokens=[mb.num_tokens for mb in microbatches],
        )
    elif acc is not None:
        acc.begin(parameters=model.parameters())
    for i, mb in enumerate(microbatches):
        with microbatch_context(model, wrapper, last=i == len(microbatches) - 1):
            loss = microbatch_loss(model, mb, weight_by, loss_reduction)
            if acc is None:
                loss = torch.nan_to_num(loss) / len(microbatches)
            elif scale_after:
                loss = acc.scale_loss(loss, num_samples=mb.num_samples, num_tokens=mb.num_tokens)
            else:
                loss = acc.scale_loss(loss)
            loss.backward()
    if acc is None:
        return None
    return acc.end(max_grad_norm=clip)


# The steps each scenario runs: count first with either loss_logging, and scale after.
MODES = {
    "count_first/end": (False, "end"),
    "count_first/next_step": (False, "next_step"),
    "scale_after": (True, None),  # loss_logging from the config: its loss travels either way
}


def scenario(rank: int, world_size: int, wrapper: str, config: dict) -> dict:
    weight_by, loss_reduction = config["weight_by"], config["loss_reduction"]
    grad_reduction = config["grad_reduction"]
    batch, sizes = global_batch(world_size, weight_by, seed=config["seed"])
    base = make_model(config["seed"])
    expected_loss, expected_grads = reference(base, batch, weight_by)
    start, stop = split(batch.num_samples, [sum(s) for s in sizes])[rank]
    mine = batch.rows(start, stop)
    my_sizes = sizes[rank]
    if wrapper == "fsdp":
        # FSDP2 all-gathers the parameters in every forward, so every rank must run as many
        # microbatches as the others: a rank with fewer rows runs empty ones.
        my_sizes = my_sizes + [0] * (max(map(len, sizes)) - len(my_sizes))
    microbatches = [mine.rows(a, b) for a, b in split(stop - start, my_sizes)]

    # The same step without lossweight: what the wrapper itself communicates.
    plain = wrap(copy.deepcopy(base), wrapper, world_size, grad_reduction)
    with count_collectives() as plain_calls:
        run_step(plain, wrapper, microbatches, weight_by, loss_reduction)

    outcome = {
        "expected_loss": expected_loss,
        "expected_tokens": int(batch.num_tokens),
        "expected_samples": batch.num_samples,
        "plain_collectives": dict(plain_calls.calls),
        "plain_relative_error": max_relative_error(full_gradients(plain), expected_grads),
    }
    grads = {}
    for mode, (scale_after, loss_logging) in MODES.items():
        model = wrap(copy.deepcopy(base), wrapper, world_size, grad_reduction)
        acc = Accumulator(
            weight_by=weight_by,
            loss_reduction=loss_reduction,
            grad_reduction=grad_reduction,
            loss_logging=loss_logging or config["scale_after_logging"],
        )
        with count_collectives() as calls:
            result = run_step(
                model, wrapper, microbatches, weight_by, loss_reduction, acc, scale_after
            )
        grads[mode] = full_gradients(model)
        try:
            result.loss  # noqa: B018 (read for its error)
            early_read = "ready"
        except RuntimeError as error:  # a next_step loss has not travelled yet
            early_read = f"RuntimeError: {error}"
        # The reduction that carries a next_step loss; nothing to carry in the other modes.
        with count_collectives() as flush_calls:
            acc.flush()
        with count_collectives() as read_calls:
            logged = result.loss.item()
            num_tokens, num_samples = int(result.num_tokens), int(result.num_samples)
            flags = bool(result.is_empty), bool(result.nonfinite_loss)
        outcome[mode] = {
            "relative_error": max_relative_error(grads[mode], expected_grads),
            "logged_loss": logged,
            "num_tokens": num_tokens,
            "num_samples": num_samples,
            "is_empty_or_nonfinite": flags,
            "step": result.step,
            "read_before_flush": early_read,
            "step_collectives": dict(calls.calls),
            "flush_collectives": dict(flush_calls.calls),
            "read_collectives": dict(read_calls.calls),
        }
    outcome["modes_relative_difference"] = max(
        max_relative_error(grads[mode], grads["count_first/end"]) for mode in MODES
    )
    # end(max_grad_norm=...) clips the rescaled gradient: that of the full batch, clipped as
    # clip_grad_norm_ clips it, to half its norm so that the clipping does clip.
    norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in expected_grads]))
    clip = float(norm) / 2
    model = wrap(copy.deepcopy(base), wrapper, world_size, grad_reduction)
    acc = Accumulator(
        weight_by=weight_by, loss_reduction=loss_reduction, grad_reduction=grad_reduction
    )
    result = run_step(model, wrapper, microbatches, weight_by, loss_reduction, acc, True, clip)
    clipped = [g * (clip / (norm + 1e-6)) for g in expected_grads]
    outcome["clipped"] = {
        "relative_error": max_relative_error(full_gradients(model), clipped),
        "norm_relative_error": abs(float(result.grad_norm) / float(norm) - 1),
    }
    return outcome


CONFIGS = {
    name: dict(
        weight_by=weight_by,
        loss_reduction=loss_reduction,
        grad_reduction=grad_reduction,
        scale_after_logging=scale_after_logging,
        seed=seed,
    )
    for name, weight_by, loss_reduction, grad_reduction, scale_after_logging, seed in [
        ("tokens-sum", "tokens", "sum", "mean", "end", 1),
        ("tokens-mean", "tokens", "mean", "mean", "next_step", 2),
        ("samples-mean", "samples", "mean", "mean", "end", 3),
        ("tokens-sum-gradsum", "tokens", "sum", "sum", "next_step", 4),
    ]
}
# FSDP2's scenarios run where torch runs FSDP2 on CPU (tests/torch_range.py).
WRAPPERS = ("ddp", "fsdp") if FSDP2_ON_CPU else ("ddp",)
SCENARIOS = [
    (wrapper, name)
    for wrapper in ("ddp", "fsdp")
    for name in CONFIGS
    if not (wrapper == "ddp" and CONFIGS[name]["grad_reduction"] == "sum")  # DDP averages
]


# Several loss terms (tests/terms_problem.py): every term counting first, and the two terms a
# scale-after step can make exact (both per token).
TERM_MODES = {
    "count_first/end": (terms_problem.TERMS, False, "end"),
    "count_first/next_step": (terms_problem.TERMS, False, "next_step"),
    "scale_after": (("lm", "mtp"), True, "end"),
}


def terms_scenario(rank: int, world_size: int, wrapper: str, mode: str) -> dict:
    """One step of several terms on an uneven share of 3 sequences per rank (rank 0 has an
    empty microbatch, and a sequence without tokens is in the step), against the full batch."""
    names, scale_after, loss_logging = TERM_MODES[mode]
    names = tuple(names)
    lengths = [3, 0, 5, 2, 4, 1, 0, 6, 2, 3, 1, 4][: 3 * world_size]
    data, base = terms_problem.make_sequences(lengths, seed=7), terms_problem.Model(7)
    truth, counts = terms_problem.reference(base, data, names)
    parameters = list(base.parameters())
    grads = torch.autograd.grad(sum(truth.values()), parameters, allow_unused=True)
    expected = [
        torch.zeros_like(p) if g is None else g for p, g in zip(parameters, grads, strict=True)
    ]
    mine = [i for i in range(len(lengths)) if i % world_size == rank]
    # As many microbatches on every rank (FSDP2 gathers the parameters at each forward).
    microbatches = [mine[:1], [], mine[1:]] if rank == 0 else [mine, [], []]
    model = copy.deepcopy(base)
    if wrapper == "ddp":
        model = DistributedDataParallel(model, find_unused_parameters=True)
    else:
        mesh = init_device_mesh("cpu", (world_size,))
        fully_shard(model.token, mesh=mesh)
        fully_shard(model, mesh=mesh)
    terms = [terms_problem.TERMS[name] for name in names]
    acc = Accumulator(terms=terms, loss_logging=loss_logging)
    pieces = []
    for rows in microbatches:  # the counts, from the data alone
        tokens = sum(len(data.weights[i]) for i in rows)
        weight = sum((data.weights[i].sum() for i in rows), torch.zeros((), dtype=torch.float64))
        pieces.append({"num_tokens": tokens, "num_samples": len(rows), "weight_sum": weight})
    if scale_after:
        acc.begin(parameters=model.parameters())
    else:
        acc.begin(**{name: [piece[name] for piece in pieces] for name in pieces[0]})
    for index, rows in enumerate(microbatches):
        with microbatch_context(model, wrapper, index == len(microbatches) - 1):
            losses, given = terms_problem.microbatch(model, data, rows, names)
            acc.scale_loss(losses, **(given if scale_after else {})).backward()
    result = acc.end()
    acc.flush()
    return {
        "relative_error": max_relative_error(full_gradients(model), expected),
        "losses": {name: value.item() for name, value in result.losses.items()},
        "expected": {name: value.item() for name, value in truth.items()},
        "loss": result.loss.item(),
        "counts": [result.num_tokens.item(), result.num_samples.item(), result.weight_sum.item()],
        "expected_counts": [counts["num_tokens"], counts["num_samples"], counts["weight_sum"]],
    }


def run(rank: int, world_size: int) -> dict:
    """Every scenario on this rank (run by tests/gloo.py's run_ranks)."""
    outcome = {
        f"{wrapper}/{name}": scenario(rank, world_size, wrapper, CONFIGS[name])
        for wrapper, name in SCENARIOS
        if wrapper in WRAPPERS
    }
    for wrapper in WRAPPERS:
        for mode in TERM_MODES:
            outcome[f"terms/{wrapper}/{mode}"] = terms_scenario(rank, world_size, wrapper, mode)
    return outcome
