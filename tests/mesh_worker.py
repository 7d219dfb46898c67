"""What each of the 4 processes of tests/test_mesh.py runs: lossweight with ``group=`` a
``DeviceMesh``, in three layouts of the same 4 gloo ranks, each a 2 x 2 mesh:

- ``"dp x cp"``: DDP over the dp and cp dimensions flattened; each cp rank holds one half of
  the positions of every sequence of its dp rank (a model that computes each token on its own,
  embedding and MLP, makes a sharded sequence exact); counts over ``mesh["dp", "cp"]``;
- ``"dp x cp, sequence mean"``: the same, with a loss that is each sequence's token mean,
  averaged over the sequences (``aggregate(..., positions=...)``: every cp rank weighs its
  share of each sequence, so that a sequence counts once);
- ``"hsdp"``: FSDP2 over a (replicate, shard) mesh, every rank with data of its own; counts over
  the whole mesh; ``"hsdp, summed"``: the same with ``set_gradient_divide_factor(1.0)`` (FSDP2
  sums the ranks' gradients) and ``grad_reduction="sum"``;
- ``"dp x tp"``: the MLP tensor-parallel over ``"tp"`` (column-wise, then row-wise), FSDP2 over
  ``"dp"``; both tp ranks of a dp rank hold its data; counts over ``mesh["dp"]``;
- ``"pp x dp, GPipe"`` and ``"pp x dp, 1F1B"``: the model split into 2 pipeline stages
  (``torch.distributed.pipelining``, each stage DDP over ``"dp"`` under GPipe, FSDP2 under 1F1B)
  that split each dp rank's batch into 2 microbatches; the loss function the schedule calls on
  the last stage scales the loss; counts over the whole mesh with ``pipeline="pp"``, every
  stage calling begin() and end(). The GPipe stages are built without their shapes, so that
  torch 2.13 runs the loss function once more to infer them at the first step; the 1F1B ones
  with them. ``"pp x dp, GPipe dividing"`` leaves the schedule's own division of the gradients
  by the number of microbatches on (``scale_grads=True``), which
  ``framework_divides_loss_by`` undoes.

The data are uneven over the dp ranks (more microbatches, more tokens), and each layout has a
microbatch without any token on some rank. Each layout runs one step counting first and one
scaling after, and returns the relative error of the full gradient (a DTensor's gathered)
against the single-process fp64 full batch, and the logged loss and count.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)
from torch.nn.parallel import DistributedDataParallel

import lossweight
from lossweight.testing import count_collectives

from .gloo import holds_a_process_group
from .problem import max_relative_error

VOCABULARY, WIDTH, LENGTH = 11, 6, 8
PIPELINES = ("pp x dp, GPipe", "pp x dp, 1F1B", "pp x dp, GPipe dividing")
# Built wrong on purpose, to show that the data tell right from wrong: the schedule divides the
# gradients by the number of microbatches, and the Accumulator is not told.
UNANNOUNCED = "pp x dp, GPipe dividing unannounced"
# Stages the Accumulator is not told of (no pipeline=): over the default group, and over a
# mesh whose stage dimension has another name. Their shapes are given, since torch's shape
# inference would call scale_loss() outside any step.
UNDECLARED = ("pp x dp, GPipe, default group", "pp x dp, GPipe, stage dimension")
LAYOUTS = ("dp x cp", "dp x cp, sequence mean", "hsdp", "hsdp, summed", "dp x tp", *PIPELINES)
MODES = ("count-first", "scale-after")


class TokenModel(torch.nn.Module):
    """Each position's logits from its own token only: sharding a sequence over ranks is exact."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCABULARY, WIDTH, dtype=torch.float64)
        self.up = torch.nn.Linear(WIDTH, 2 * WIDTH, dtype=torch.float64)
        self.down = torch.nn.Linear(2 * WIDTH, VOCABULARY, dtype=torch.float64)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(self.embed(tokens))))


def microbatch(seed: int, rows: int, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and labels of ``rows`` sequences padded to LENGTH (label -100 past each length)."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCABULARY, (rows, LENGTH), generator=generator)
    labels = torch.randint(0, VOCABULARY, (rows, LENGTH), generator=generator)
    kept = torch.arange(LENGTH) < torch.tensor(lengths)[:, None]
    return tokens, labels.masked_fill(~kept, -100)


# Each data holder's microbatches, as (seed, rows, lengths): dp rank 0 of "dp x cp" has three
# microbatches, dp rank 1 one; a length of at most 4 leaves the second half of the positions
# (cp rank 1's) without a token.
DATA: dict[str, list[list[tuple[int, int, list[int]]]]] = {
    "dp x cp": [
        [(1, 2, [8, 3]), (2, 2, [2, 4]), (3, 2, [6, 7])],
        [(4, 2, [8, 5])],
    ],
    "hsdp": [  # FSDP2 gathers the parameters in every forward: as many microbatches each
        [(5, 2, [8, 7]), (6, 2, [1, 2])],
        [(7, 2, [3, 0]), (8, 2, [0, 0])],
        [(9, 2, [8, 8]), (10, 2, [8, 6])],
        [(11, 2, [2, 2]), (12, 2, [5, 1])],
    ],
    "dp x tp": [
        [(13, 2, [8, 1]), (14, 2, [0, 0])],
        [(15, 2, [7, 6]), (16, 2, [8, 8])],
    ],
    # Each dp rank's batch of 4 rows, which the schedule splits into 2 microbatches of 2 rows;
    # dp rank 1's second microbatch has no token.
    "pp x dp": [
        [(17, 4, [8, 3, 5, 8])],
        [(18, 4, [2, 7, 0, 0])],
    ],
}


def reference(model: torch.nn.Module, layout: str) -> dict[str, Any]:
    """The full batch's loss (its token mean, or its sequences' mean of their token means),
    count and gradient, in one process."""
    model = copy.deepcopy(model)
    data = DATA[layout.split(",")[0] if "," in layout else layout]
    pieces = [microbatch(*spec) for holder in data for spec in holder]
    tokens = torch.cat([t for t, _ in pieces])
    labels = torch.cat([y for _, y in pieces])
    loss_sum, count = lossweight.token_cross_entropy(model(tokens), labels)
    loss = loss_sum / count
    if layout.endswith("sequence mean"):
        per_token = torch.nn.functional.cross_entropy(
            model(tokens).transpose(1, 2), labels, reduction="none"
        )
        kept = labels != -100
        means = [per_token[i][kept[i]].mean() for i in range(len(labels)) if kept[i].any()]
        loss, count = torch.stack(means).mean(), torch.tensor(len(means))
    loss.backward()
    return {
        "loss": loss.item(),
        "tokens": count.item(),
        "grads": [p.grad.detach().clone() for p in model.parameters()],
    }


def full(grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    if grad is None:
        return torch.zeros_like(like)
    return grad.full_tensor() if hasattr(grad, "full_tensor") else grad


def token_mean(
    model: torch.nn.Module, tokens: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss_sum, count = lossweight.token_cross_entropy(model(tokens), labels)
    return loss_sum, {"num_tokens": count}


def step(
    model: torch.nn.Module,
    acc: lossweight.Accumulator,
    pieces: list[tuple[torch.Tensor, torch.Tensor]],
    mode: str,
    sync: Any,
    loss_of: Any = token_mean,
) -> lossweight.StepResult:
    """One step over this rank's microbatches; ``sync(last)`` gives the wrapper's context,
    ``loss_of(model, tokens, labels)`` a microbatch's summed loss and its counts."""
    if mode == "count-first":
        counts = [loss_of(lambda t: torch.zeros(*t.shape, VOCABULARY), t, y)[1] for t, y in pieces]
        acc.begin(**{name: [c[name] for c in counts] for name in counts[0]})
    else:
        acc.begin(parameters=model)
    for i, (tokens, labels) in enumerate(pieces):
        with sync(i == len(pieces) - 1):
            loss_sum, counts = loss_of(model, tokens, labels)
            acc.scale_loss(loss_sum, **(counts if mode == "scale-after" else {})).backward()
    return acc.end()


def run(rank: int, world_size: int) -> dict:
    assert world_size == 4
    torch.manual_seed(0)
    base = TokenModel()
    outcome: dict[str, Any] = {}
    for layout in (*LAYOUTS, UNANNOUNCED):
        expected = reference(base, layout)
        for mode in MODES:
            result, model = _layout_step(layout, mode, base)
            grads = [full(p.grad, p) for p in model.parameters()]
            sequences = layout.endswith("sequence mean")
            outcome[f"{layout}/{mode}"] = {
                "relative_error": max_relative_error(grads, expected["grads"]),
                "loss": result.loss.item(),
                "tokens": (result.weight_sum if sequences else result.num_tokens).item(),
                "expected_loss": expected["loss"],
                "expected_tokens": expected["tokens"],
                "lossweight_collectives": COLLECTIVES.get(f"{layout}/{mode}"),
                "samples": SAMPLES.get(f"{layout}/{mode}"),
            }
    for layout in UNDECLARED:  # every rank raises: at end(), or reading the loss
        for mode in MODES:
            try:
                _pipeline_step(layout, mode, copy.deepcopy(base))
            except RuntimeError as refused:
                outcome[f"{layout}/{mode}"] = str(refused)
    stages = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    acc = lossweight.Accumulator(loss_reduction="sum", group=stages, pipeline="pp")
    acc.begin(num_tokens=[3])
    if stages["pp"].get_local_rank() == 0:
        try:
            acc.scale_loss(torch.tensor(1.0))
        except RuntimeError as refused:
            outcome["first_stage_scales"] = str(refused)
    acc.abandon()
    acc.begin(parameters=[torch.nn.Parameter(torch.ones(()))])
    try:
        acc.end(max_grad_norm=1.0)
    except ValueError as refused:
        outcome["pipeline_clip"] = str(refused)
    acc.abandon()
    outcome.update(_tensor_parallel_steps())
    outcome.update(_dimensions_outside_the_group())
    # A mesh made with _unflatten has a 1-D root: its whole is taken, a part of it refused.
    world = init_device_mesh("cpu", (4,), mesh_dim_names=("world",))
    unflattened = world._unflatten(0, (2, 2), ("replicate", "shard"))
    whole = lossweight.Accumulator(loss_reduction="sum", group=unflattened)
    outcome["unflattened_whole"] = list(whole._resolver.parallel.peers)  # type: ignore[union-attr]
    for name, mesh in {
        "partial_refused": unflattened["replicate"],
        "tp_refused": init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")),
        "pp_refused": stages,
        "unnamed_refused": init_device_mesh("cpu", (2, 2)),
    }.items():
        try:
            lossweight.Accumulator(loss_reduction="sum", group=mesh)
        except ValueError as refused:
            outcome[name] = str(refused)
    return outcome


# This rank's counts per microbatch, by (dp rank, tp rank), where the ranks of a
# tensor-parallel group give different counts: in one group only; in both, with each tp
# rank's sum over the dp ranks the same (8 and 8), which a check of those sums alone would
# pass; and with the same totals in every group, in another order of microbatches, whose
# factors would differ, given as Python numbers, as tensors (the counts one would keep on
# the device), and mixed (a 0-dim tensor first on tp rank 0, last on tp rank 1).
TP_COUNTS_DIFFER = {
    "one_group": {(0, 0): [3], (0, 1): [4], (1, 0): [5], (1, 1): [5]},
    "cancelling": {(0, 0): [5], (0, 1): [3], (1, 0): [3], (1, 1): [5]},
    "order": {(0, 0): [3, 5], (0, 1): [5, 3], (1, 0): [4], (1, 1): [4]},
    "order_in_tensors": {(0, 0): [3, 5], (0, 1): [5, 3], (1, 0): [4], (1, 1): [4]},
    "order_mixed": {(0, 0): [3, 5], (0, 1): [5, 3], (1, 0): [4], (1, 1): [4]},
}


def _given_as(case: str, counts: list[int], tp: int) -> Any:
    """``counts`` as the case gives them: numbers, a tensor, or one 0-dim tensor among numbers
    (the first on tp rank 0, the last on tp rank 1)."""
    if case.endswith("tensors"):
        return torch.tensor(counts)
    if case.endswith("mixed"):
        at = 0 if tp == 0 else len(counts) - 1
        return [torch.tensor(c) if i == at else c for i, c in enumerate(counts)]
    return counts


TP_AGREE = {(0, 0): [3, 5], (0, 1): [3, 5], (1, 0): [0, 4], (1, 1): [0, 4]}


def _one_step(
    acc: lossweight.Accumulator,
    parameter: torch.nn.Parameter,
    counts: Any,
    mode: str,
    per_token: float = 2.0,
) -> lossweight.StepResult:
    """A step whose microbatches' summed losses are ``per_token`` per token, of one
    parameter."""
    parameter.grad = None
    if mode == "count-first":
        acc.begin(num_tokens=counts)
    else:
        acc.begin(parameters=[parameter])
    for i, count in enumerate(counts):
        given = {} if mode == "count-first" else {"num_tokens": count}
        acc.scale_loss(parameter * per_token * count + i * 0, **given).backward()
    return acc.end()


# Dimensions that group= leaves out, checked by what their ranks count, whatever their names:
# (the mesh's dimensions, those of group=, this rank's count by its place on the mesh).
OUTSIDE = {
    "cp left out": (("dp", "cp"), ("dp",), lambda dp, cp: 3 + 2 * cp),  # each its own half
    "hsdp replicate alone": (("replicate", "shard"), ("replicate",), lambda r, s: 3 + s),
    # The same counts on every rank, different data: told apart by their losses.
    "hsdp replicate alone, same counts": (("replicate", "shard"), ("replicate",), lambda r, s: 4),
    "tp under another name, own shard": (("dp", "model"), ("dp",), lambda dp, m: 4 + m),
    "tp under another name, whole batch": (("dp", "model"), ("dp",), lambda dp, m: 4 + dp),
    "pp left out, zeros before the last": (("pp", "dp"), ("dp",), lambda pp, dp: 4 * pp),
    "flattened": (("dp", "cp"), ("dp", "cp"), lambda dp, cp: 3 + 2 * cp),
    "whole world under tp": (("dp", "tp"), (), lambda dp, tp: 4 + dp),
}


def _dimensions_outside_the_group() -> dict[str, Any]:
    """Each case of OUTSIDE in both modes: what the step reports, or the error every rank
    raises; and for the whole world under tp (the default group), the gradient that a DDP-style
    mean over the dp ranks makes of the ranks' scaled gradients."""
    parameter = torch.nn.Parameter(torch.ones((), dtype=torch.float64))
    outcome: dict[str, Any] = {}
    for case, (names, spanned, count) in OUTSIDE.items():
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
        place = [mesh[name].get_local_rank() for name in names]
        group: Any = None if not spanned else mesh[spanned]
        group = group._flatten() if case == "flattened" else group
        for mode in MODES:
            acc = lossweight.Accumulator(loss_reduction="sum", group=group)
            try:
                per_token = 2.0 + place[1] if case.endswith("same counts") else 2.0
                result = _one_step(acc, parameter, [count(*place)], mode, per_token)
                seen = {"tokens": result.num_tokens.item(), "loss": result.loss.item()}
                gradient = parameter.grad.detach().clone()
                dist.all_reduce(gradient, group=mesh[names[0]].get_group())
                outcome[f"outside/{case}/{mode}"] = {**seen, "gradient": gradient.item() / 2}
            except lossweight.DisagreementError as refused:
                outcome[f"outside/{case}/{mode}"] = str(refused)
            acc.abandon()
    return outcome


def _tensor_parallel_steps() -> dict[str, Any]:
    """What each mode raises when the tp ranks of a dp rank give different counts, and a run
    of two steps whose ranks agree, its loss carried to the next step and to flush()."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    place = (mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank())
    parameter = torch.nn.Parameter(torch.ones((), dtype=torch.float64))
    outcome: dict[str, Any] = {}

    def one_step(acc: lossweight.Accumulator, counts: Any, mode: str) -> Any:
        return _one_step(acc, parameter, counts, mode)

    for case, counts in TP_COUNTS_DIFFER.items():
        for mode in MODES:
            acc = lossweight.Accumulator(loss_reduction="sum", group=mesh["dp"])
            given = _given_as(case, counts[place], place[1])
            try:
                one_step(acc, given, mode)
            except lossweight.DisagreementError as refused:
                outcome[f"tp_differ/{case}/{mode}"] = str(refused)
            acc.abandon()
    # 2 pipeline stages of 2 tp ranks each: the last stage's tp ranks give 4 and 4 tokens, or
    # 4 and 5, which every rank of both stages is told of.
    stages = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("pp", "dp", "tp"))
    last, tp = stages["pp"].get_local_rank() == 1, stages["tp"].get_local_rank()
    for case, given in {"agree": [4, 4], "differ": [4, 5]}.items():
        for mode in MODES:
            acc = lossweight.Accumulator(
                loss_reduction="sum", group=stages["pp", "dp"], pipeline="pp"
            )
            try:
                if last:
                    result = one_step(acc, [given[tp]], mode)
                elif mode == "count-first":  # an earlier stage: begin() and end() only
                    acc.begin(num_tokens=[0])
                    result = acc.end()
                else:
                    parameter.grad = None
                    acc.begin(parameters=[parameter])
                    result = acc.end()
                seen = {"tokens": result.num_tokens.item(), "loss": result.loss.item()}
                outcome[f"pp_tp/{case}/{mode}"] = seen
            except lossweight.DisagreementError as refused:
                outcome[f"pp_tp/{case}/{mode}"] = str(refused)
            acc.abandon()
    for mode in MODES:
        acc = lossweight.Accumulator(
            loss_reduction="sum", group=mesh["dp"], loss_logging="next_step"
        )
        first, second = one_step(acc, TP_AGREE[place], mode), one_step(acc, [1], mode)
        acc.flush()
        outcome[f"tp_agree/{mode}"] = {
            "losses": [first.loss.item(), second.loss.item()],
            "tokens": [first.num_tokens.item(), second.num_tokens.item()],
            "gradient": parameter.grad.item(),  # the second step's
            # the dp x tp group lossweight made is torch's to keep, and to free
            "holds_a_group": holds_a_process_group(acc, first, second),
        }
        # The same counts as numbers on one tp rank and as a tensor on the other: they agree.
        acc = lossweight.Accumulator(loss_reduction="sum", group=mesh["dp"])
        given = _given_as("tensors" if place[1] else "numbers", TP_AGREE[place], place[1])
        try:
            outcome[f"tp_agree_as_tensor/{mode}"] = one_step(acc, given, mode).num_tokens.item()
        except lossweight.DisagreementError as refused:
            outcome[f"tp_agree_as_tensor/{mode}"] = str(refused)
        acc.abandon()
    return outcome


def _layout_step(
    layout: str, mode: str, base: torch.nn.Module
) -> tuple[lossweight.StepResult, torch.nn.Module]:
    model = copy.deepcopy(base)
    acc = lossweight.Accumulator(loss_reduction="sum")  # the group is set per layout below
    if layout.startswith("dp x cp"):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
        dp, cp = mesh["dp"].get_local_rank(), mesh["cp"].get_local_rank()
        half = slice(cp * LENGTH // 2, (cp + 1) * LENGTH // 2)
        wrapped = DistributedDataParallel(model, device_mesh=mesh["dp", "cp"]._flatten())

        def sync(last: bool) -> Any:
            return contextlib.nullcontext() if last else wrapped.no_sync()

        if layout == "dp x cp":
            pieces = [(t[:, half], y[:, half]) for t, y in map(_unpack, DATA[layout][dp])]
            acc = lossweight.Accumulator(loss_reduction="sum", group=mesh["dp", "cp"])
            return step(wrapped, acc, pieces, mode, sync), wrapped.module

        def sequence_mean(
            model: Any, tokens: torch.Tensor, labels: torch.Tensor
        ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            # This rank's half of each sequence; the whole mask gives each sequence's size.
            per_token = torch.nn.functional.cross_entropy(
                model(tokens[:, half]).transpose(1, 2), labels[:, half].clamp(min=0),
                reduction="none",
            )  # fmt: skip
            loss, share = lossweight.aggregate(
                per_token, (labels != -100).long(), mode="seq-mean-token-mean", positions=half
            )
            return loss, {"weight_sum": share}

        pieces = list(map(_unpack, DATA["dp x cp"][dp]))
        terms = [lossweight.Term("loss", "sum", "weight_sum")]
        acc = lossweight.Accumulator(terms=terms, group=mesh["dp", "cp"])
        return step(wrapped, acc, pieces, mode, sync, sequence_mean), wrapped.module
    if layout in (*PIPELINES, UNANNOUNCED, *UNDECLARED):
        return _pipeline_step(layout, mode, model)
    if layout.startswith("hsdp"):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        pieces = [_unpack(spec) for spec in DATA["hsdp"][dist.get_rank()]]
        for layer in (model.embed, model.up, model.down, model):
            fully_shard(layer, mesh=mesh)
        summed = layout.endswith("summed")  # FSDP2 sums the ranks' gradients, dividing by 1
        for layer in (model.embed, model.up, model.down, model) if summed else ():
            layer.set_gradient_divide_factor(1.0)  # type: ignore[operator]
        reduction = "sum" if summed else "mean"
        acc = lossweight.Accumulator(loss_reduction="sum", group=mesh, grad_reduction=reduction)
    else:  # dp x tp
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dp = mesh["dp"].get_local_rank()
        pieces = [_unpack(spec) for spec in DATA[layout][dp]]
        parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
        acc = lossweight.Accumulator(loss_reduction="sum", group=mesh["dp"])

    def fsdp_sync(last: bool) -> Any:
        model.set_requires_gradient_sync(last)  # type: ignore[operator]
        return contextlib.nullcontext()

    return step(model, acc, pieces, mode, fsdp_sync), model


# The collectives lossweight issued in each pipelined step, by its name in ``run()``'s outcome.
COLLECTIVES: dict[str, dict[str, int]] = {}
SAMPLES: dict[str, int] = {}  # and the rows they reported


@contextlib.contextmanager
def paused(seen: Any) -> Any:
    """Leave out of ``seen`` what the block issues (the schedule's own sends and receives)."""
    before = seen.calls.copy()
    yield
    seen.calls.clear()
    seen.calls.update(before)


class Stage(torch.nn.Module):
    """One pipeline stage of a TokenModel: the embedding and the first layer, or the rest."""

    def __init__(self, model: TokenModel, first: bool) -> None:
        super().__init__()
        self.first = first
        if first:
            self.embed, self.up = model.embed, model.up
        else:
            self.down = model.down

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        if self.first:
            return self.up(self.embed(inputs))
        return self.down(torch.relu(inputs))


def _pipeline_step(
    layout: str, mode: str, model: TokenModel
) -> tuple[lossweight.StepResult, torch.nn.Module]:
    undeclared = layout in UNDECLARED
    names = ("stage", "dp") if layout.endswith("stage dimension") else ("pp", "dp")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
    pp, dp = mesh[names[0]].get_local_rank(), mesh["dp"].get_local_rank()
    tokens, labels = _unpack(DATA["pp x dp"][dp][0])
    stage_module: torch.nn.Module = Stage(model, first=pp == 0)
    if layout.endswith("1F1B"):
        stage_module = fully_shard(stage_module, mesh=mesh["dp"])
    else:
        stage_module = DistributedDataParallel(stage_module, process_group=mesh["dp"].get_group())
    shapes: dict[str, Any] = {}
    if layout.endswith("1F1B") or undeclared:  # one microbatch's input and output
        hidden = torch.zeros(2, LENGTH, 2 * WIDTH, dtype=torch.float64, requires_grad=True)
        logits = torch.zeros(2, LENGTH, VOCABULARY, dtype=torch.float64)
        shapes = {"input_args": tokens[:2] if pp == 0 else hidden}
        shapes["output_args"] = hidden if pp == 0 else logits
    group = mesh[names[0]].get_group()
    stage = PipelineStage(stage_module, pp, 2, torch.device("cpu"), group=group, **shapes)
    dividing = "dividing" in layout
    acc = lossweight.Accumulator(
        loss_reduction="sum", group=mesh, pipeline="pp",
        framework_divides_loss_by=2 if layout.endswith("dividing") else 1,
    ) if not undeclared else lossweight.Accumulator(
        loss_reduction="sum", group=None if layout.endswith("default group") else mesh
    )  # fmt: skip

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss_sum, count = lossweight.token_cross_entropy(output, target)
        return acc.scale_loss(loss_sum, **({"num_tokens": count} if mode == "scale-after" else {}))

    kind = Schedule1F1B if layout.endswith("1F1B") else ScheduleGPipe
    schedule = kind(stage, 2, loss_fn=loss_fn, scale_grads=dividing)
    with count_collectives() as seen:  # lossweight's own, around the schedule's step
        if mode == "count-first" and pp == 1:  # the last stage's counts are the step's
            counts = [lossweight.count_tokens(y) for y in labels.tensor_split(2)]
            acc.begin(num_tokens=counts, num_samples=[2, 2])
        elif mode == "count-first":  # an earlier stage may give zeros (or the same counts)
            acc.begin(num_tokens=[0, 0])
        else:
            acc.begin(parameters=stage_module)
        with paused(seen):
            schedule.step(tokens) if pp == 0 else schedule.step(target=labels)
        result = acc.end()
        result.loss.item()  # a count-first step reduces its loss in end()
    COLLECTIVES[f"{layout}/{mode}"] = dict(seen.calls)
    SAMPLES[f"{layout}/{mode}"] = int(result.num_samples.item())
    # The whole model's gradient, each stage's part from the ranks that hold that stage.
    held = {n: full(p.grad, p).tolist() for n, p in model.named_parameters() if p.grad is not None}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, held)
    whole = copy.deepcopy(TokenModel())
    for name, parameter in whole.named_parameters():
        grad = next(g[name] for g in gathered if name in g)
        parameter.grad = torch.tensor(grad, dtype=torch.float64)
    return result, whole


def _unpack(spec: tuple[int, int, list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    return microbatch(*spec)


def one_stage(rank: int, world_size: int, told: bool) -> dict:
    """A pipeline of one stage on one process, whose stage is built without its shapes, so
    that torch 2.13 calls the loss function to infer them at the first step: with ``told``,
    the Accumulator knows of the pipeline (a mesh with a "pp" dimension of size 1)."""
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("pp", "dp"))
    torch.manual_seed(0)
    model = TokenModel()
    options: dict[str, Any] = {"group": mesh, "pipeline": "pp"} if told else {}
    acc = lossweight.Accumulator(loss_reduction="sum", **options)

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return acc.scale_loss(lossweight.token_cross_entropy(output, target)[0])

    stage = PipelineStage(model, 0, 1, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = ScheduleGPipe(stage, 2, loss_fn=loss_fn, scale_grads=False)
    tokens, labels = _unpack(DATA["pp x dp"][0][0])
    acc.begin(num_tokens=[lossweight.count_tokens(y) for y in labels.tensor_split(2)])
    try:
        schedule.step(tokens, target=labels)
    except RuntimeError as refused:
        return {"refused": str(refused)}
    acc.end()
    whole = copy.deepcopy(model)
    whole.zero_grad()
    loss_sum, count = lossweight.token_cross_entropy(whole(tokens), labels)
    (loss_sum / count).backward()
    grads = [p.grad for p in model.parameters()]
    return {"relative_error": max_relative_error(grads, [p.grad for p in whole.parameters()])}
