"""Ranks that disagree, read alone, sit idle or see a NaN, over real gloo process groups.

Two processes per launch (tests/gloo.py). Every scenario must end within seconds, on every
rank, with its expected outcome: a DisagreementError that names what differs, or the right
numbers. Never a gloo timeout (each scenario must take well under the collective timeout),
never a hang (the launch's deadline kills it), never a wrong number.

The scenarios run one after the other in a single launch (starting the processes is most of
its cost), each timed and recorded on its own, so that each test below reports its own
scenario. The hardening scenarios come first, with Accumulators built before the process group
exists, and reduce over the default group as a DDP run does; then each protocol scenario
reduces over a process group of its own, so that one that left the ranks' collectives unpaired
could not disturb the next.
"""

from __future__ import annotations

import copy
import math
import pickle
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lossweight import Accumulator, DisagreementError, Term
from lossweight.collectives import SingleProcess
from lossweight.testing import count_collectives

from . import gloo
from .distributed_worker import (
    full_gradients,
    global_batch,
    microbatch_context,
    wrap,
)
from .problem import make_model, max_relative_error, microbatch_loss, reference, split

# Every option named in a disagreement message ("the ranks differ in <option>").
OPTIONS = ("their loss terms", "loss_logging", "grad_reduction")


# ---------------------------------------------------------------------------------------------
# What the ranks run
# ---------------------------------------------------------------------------------------------


def _where(error: BaseException) -> str:
    """The line of this file that raised, for the failure messages."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename == __file__]
    return f"line {frames[-1].lineno}: {frames[-1].line}" if frames else "?"


def _attempt(body: Callable[[], Any]) -> dict[str, Any]:
    start = time.monotonic()
    try:
        record: dict[str, Any] = {"values": body()}
    except Exception as error:
        record = {
            "error": type(error).__name__,
            "message": str(error),
            "at": _where(error),
            "lossweight's": isinstance(error, DisagreementError),
        }
    record["seconds"] = time.monotonic() - start
    return record


def _scalar(value: float = 1.0) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float64, requires_grad=True)


def count_first_step(acc: Accumulator, x: torch.Tensor, losses: list[float], counts: list[int]):
    """One count-first step of microbatches of mean loss ``l * x``, ``l`` in ``losses``."""
    acc.begin(num_tokens=counts)
    for loss in losses:
        acc.scale_loss(loss * x).backward()
    return acc.end()


def scale_after_step(acc: Accumulator, x: torch.Tensor, losses: list[float], counts: list[int]):
    """The same step, scaling after."""
    acc.begin(parameters=[x])
    for loss, count in zip(losses, counts, strict=True):
        acc.scale_loss(loss * x, num_tokens=count).backward()
    return acc.end()


STEPS = {"count_first": count_first_step, "scale_after": scale_after_step}

PROTOCOL: dict[str, Callable[[int, dist.ProcessGroup], Any]] = {}


def protocol(name: str):
    def register(function: Callable[[int, dist.ProcessGroup], Any]):
        PROTOCOL[name] = function
        return function

    return register


def _options_differ(rank: int, group: dist.ProcessGroup, **options: tuple) -> None:
    """A count-first step whose Accumulators differ in ``options`` (rank r takes value r)."""
    chosen = {name: values[rank] for name, values in options.items()}
    acc = Accumulator(group=group, **{"loss_reduction": "mean", **chosen})
    x = _scalar()
    acc.begin(num_samples=[1, 2], num_tokens=[3, 4])
    for loss in (1.0, 2.0):
        acc.scale_loss(loss * x).backward()
    acc.end()


@protocol("weight_by")
def _weight_by(rank: int, group: dist.ProcessGroup) -> None:
    _options_differ(rank, group, weight_by=("tokens", "samples"))


@protocol("term_names")
def _term_names(rank: int, group: dist.ProcessGroup) -> None:
    other = ("aux", "kl")[rank]
    terms = [Term("lm", "sum"), Term(other, "mean", "samples")]
    acc, x = Accumulator(group=group, terms=terms), _scalar()
    acc.begin(num_samples=[1, 2], num_tokens=[3, 4])
    for loss in (1.0, 2.0):
        acc.scale_loss({"lm": loss * x, other: loss * x}).backward()
    acc.end()


@protocol("term_count")
def _term_count(rank: int, group: dist.ProcessGroup) -> None:
    # Rank 1 has one term more: the payloads still have one length, so the ranks disagree in
    # the terms' digest (an error on every rank) instead of hanging in the all-reduce.
    terms = [Term("lm", "sum"), Term("aux", "mean", "samples")][: rank + 1]
    acc, x = Accumulator(group=group, terms=terms), _scalar()
    acc.begin(num_samples=[1, 2], num_tokens=[3, 4])
    for loss in (1.0, 2.0):
        acc.scale_loss({term.name: loss * x for term in terms}).backward()
    acc.end()


@protocol("loss_reduction")
def _loss_reduction(rank: int, group: dist.ProcessGroup) -> None:
    _options_differ(rank, group, loss_reduction=("mean", "sum"))


@protocol("grad_reduction")
def _grad_reduction(rank: int, group: dist.ProcessGroup) -> None:
    _options_differ(rank, group, grad_reduction=("mean", "sum"))  # D = 2 against D = 1


@protocol("loss_logging")
def _loss_logging(rank: int, group: dist.ProcessGroup) -> None:
    _options_differ(rank, group, loss_logging=("end", "next_step"))


@protocol("same_divisor_spelled_differently")
def _same_divisor(rank: int, group: dist.ProcessGroup) -> dict:
    # "mean" over 2 ranks and 2.0 are the same D: no disagreement, and the right numbers.
    acc = Accumulator(group=group, loss_reduction="mean", grad_reduction=("mean", 2.0)[rank])
    x = _scalar()
    result = count_first_step(acc, x, [1.0, 3.0][rank:], [1, 2][rank:])
    return {"loss": result.loss.item(), "grad": x.grad.item()}


@protocol("mode")
def _mode(rank: int, group: dist.ProcessGroup) -> None:
    # Rank 0 counts first, rank 1 scales after: rank 0's begin() meets rank 1's end().
    acc = Accumulator(group=group, loss_reduction="mean")
    STEPS[("count_first", "scale_after")[rank]](acc, _scalar(), [1.0, 2.0], [3, 4])


def _abandon_alone(rank: int, group: dist.ProcessGroup, mode: str) -> None:
    """Rank 0 abandons step 2 half-way and moves on; rank 1 ends it."""
    acc = Accumulator(group=group, loss_reduction="mean")
    for step in (1, 2, 3):
        x = _scalar()
        if rank == 0 and step == 2:
            if mode == "count_first":
                acc.begin(num_tokens=[3, 4])
                acc.scale_loss(1.0 * x).backward()
            else:
                acc.begin(parameters=[x])
                acc.scale_loss(1.0 * x, num_tokens=3).backward()
            acc.abandon()
            continue
        STEPS[mode](acc, x, [1.0, 2.0], [3, 4])


@protocol("abandoned_alone/count_first")
def _abandon_alone_count_first(rank: int, group: dist.ProcessGroup) -> None:
    _abandon_alone(rank, group, "count_first")


@protocol("abandoned_alone/scale_after")
def _abandon_alone_scale_after(rank: int, group: dist.ProcessGroup) -> None:
    _abandon_alone(rank, group, "scale_after")


@protocol("extra_step")
def _extra_step(rank: int, group: dist.ProcessGroup) -> None:
    # Rank 1 runs one step more than rank 0, then both flush the waiting loss: rank 0's flush()
    # meets rank 1's third begin(). (With loss_logging="end" and nothing after the steps, see
    # one_extra_step.)
    acc = Accumulator(group=group, loss_reduction="mean", loss_logging="next_step")
    result = None
    for _ in range(2 + rank):
        result = count_first_step(acc, _scalar(), [1.0, 2.0], [3, 4])
    acc.flush()
    result.loss.item()  # type: ignore[union-attr]


@protocol("weight_estimate")
def _weight_estimate(rank: int, group: dist.ProcessGroup) -> None:
    # A scale-after step under DDP whose ranks assume different estimates of W: their
    # provisional gradients are averaged at different scales, so end() must refuse them.
    acc = Accumulator(group=group, loss_reduction="mean", weight_estimate=(1.0, 1000.0)[rank])
    scale_after_step(acc, _scalar(), [1.0, 2.0], [3, 4])


@protocol("weight_estimate/reduced")
def _weight_estimate_reduced(rank: int, group: dist.ProcessGroup) -> None:
    # The same saved estimate, options that differ, then an empty count-first step: each rank
    # would fall back to its own option, and DDP would average gradients at different scales.
    acc = Accumulator(group=group, loss_reduction="sum", weight_estimate=(1.0, 1000.0)[rank])
    acc.load_state_dict({**acc.state_dict(), "weight_estimate": 8.0})
    count_first_step(acc, _scalar(), [1.0], [0])
    scale_after_step(acc, _scalar(), [1.0, 2.0], [3, 4])


@protocol("max_grad_norm")
def _max_grad_norm(rank: int, group: dist.ProcessGroup) -> None:
    # A scale-after step whose end() clips on rank 0 alone: under DDP the replicas would then
    # step with different gradients, so end() must refuse on both, before either clips.
    acc = Accumulator(group=group, loss_reduction="mean")
    x = _scalar()
    acc.begin(parameters=[x])
    for loss, count in zip([1.0, 2.0], [3, 4], strict=True):
        acc.scale_loss(loss * x, num_tokens=count).backward()
    acc.end(max_grad_norm=(0.5, None)[rank])


@protocol("abandoned_alone/next_step")
def _abandoned_next_step(rank: int, group: dist.ProcessGroup) -> dict:
    # Rank 0 abandons step 2 while rank 1 ends it, with loss_logging="next_step": the step
    # numbers still agree at step 3, but only rank 1's begin() carries a loss.
    acc = Accumulator(group=group, loss_reduction="mean", loss_logging="next_step")
    for step in (1, 2, 3):
        x = _scalar()
        if rank == 0 and step == 2:
            acc.begin(num_tokens=[3, 4])
            acc.abandon()
            continue
        count_first_step(acc, x, [1.0, 2.0], [3, 4])
    return {}


def _skipping(rank: int, group: dist.ProcessGroup, skipped: int) -> list:
    """Steps numbered by the loop (begin(step=...)); rank 1 skips iteration ``skipped``."""
    acc = Accumulator(group=group, loss_reduction="mean")
    seen = []
    for iteration in range(1, 5):
        if rank == 1 and iteration == skipped:
            continue
        acc.begin(num_tokens=[iteration], step=iteration)
        acc.scale_loss(float(iteration) * _scalar()).backward()
        seen.append(acc.end().loss.item())
    return seen


for _skipped in (1, 2, 3):
    protocol(f"skipped_iteration_{_skipped}")(
        lambda rank, group, skipped=_skipped: _skipping(rank, group, skipped)
    )


@protocol("destroyed_group")
def _destroyed_group(rank: int, group: dist.ProcessGroup) -> None:
    own = dist.new_group(backend="gloo")
    acc = Accumulator(group=own, loss_reduction="mean")
    count_first_step(acc, _scalar(), [1.0], [1])
    dist.destroy_process_group(own)
    acc.begin(num_tokens=[1])


def _pending_then_new_world(rank: int) -> dict:
    """A loss waits (loss_logging="next_step") when the default group is torn down; each
    rank then goes on alone, in a world of one."""
    acc = Accumulator(loss_reduction="mean", loss_logging="next_step")
    waiting = count_first_step(acc, _scalar(), [1.0 + rank], [3])
    dist.destroy_process_group()
    held = gloo.holds_a_process_group(acc, waiting)
    refused = _attempt(lambda: acc.begin(num_tokens=[1]))
    unreduced = _attempt(lambda: waiting.loss)
    after = _attempt(lambda: count_first_step(acc, _scalar(), [5.0], [2]).step)
    return {"refused": refused, "unreduced": unreduced, "after": after, "held": held}


def one_extra_step(rank: int, world_size: int) -> list:
    """Both ranks run steps 1 to 3 (loss_logging="end"); rank 1 also runs its step-1 batch a
    second time before step 2, a retried batch, say."""
    acc = Accumulator(loss_reduction="mean")
    seen = []
    for step in [1, 2, 3] if rank == 0 else [1, 1, 2, 3]:
        result = count_first_step(acc, _scalar(), [float(step)], [step])
        seen.append({"step": result.step, "loss": result.loss.item()})
    return seen


@protocol("idle_rank_counts_first")
def _idle_counts_first(rank: int, group: dist.ProcessGroup) -> None:
    # Rank 0 has no microbatch and declares an empty count-first step; rank 1 scales after.
    acc = Accumulator(group=group, loss_reduction="mean")
    if rank == 0:
        acc.begin(num_tokens=[])
        acc.end()
    else:
        scale_after_step(acc, _scalar(2.0), [1.5, 4.0], [2, 3])


@protocol("idle_rank_scales_after")
def _idle_scales_after(rank: int, group: dist.ProcessGroup) -> dict:
    # The supported way: the idle rank opens a scale-after step and ends it, with no
    # microbatch. Rank 1's mean losses 1.5 x and 4 x over 2 and 3 tokens, at x = 2: the step's
    # loss is (2 * 3 + 3 * 8) / 5 = 6 and its gradient (2 * 1.5 + 3 * 4) / 5 = 3.
    acc = Accumulator(group=group, loss_reduction="mean")
    x = _scalar(2.0)
    if rank == 0:
        acc.begin(parameters=[x])
        result = acc.end()
    else:
        result = scale_after_step(acc, x, [1.5, 4.0], [2, 3])
    # What DDP does with the ranks' gradients: their mean (an idle rank's are zero).
    grad = x.grad.clone() if x.grad is not None else torch.zeros_like(x)
    dist.all_reduce(grad, group=group)
    return {
        "loss": result.loss.item(),
        "grad": grad.item() / 2,
        "num_tokens": int(result.num_tokens),
    }


def _rank0_reads(rank: int, group: dist.ProcessGroup, mode: str, loss_logging: str) -> dict:
    """Three steps; only rank 0 reads each step's loss, and rank 1 reads nothing at all. Step s:
    rank 0's mean losses s and 4 over 2 and 1 tokens, rank 1's 2 s over 3 tokens: the loss is
    (2 s + 4 + 6 s) / 6."""
    acc = Accumulator(group=group, loss_reduction="mean", loss_logging=loss_logging)
    read, previous = [], None
    with count_collectives() as calls:
        for step in (1, 2, 3):
            x = _scalar()
            losses, counts = ([float(step), 4.0], [2, 1]) if rank == 0 else ([2.0 * step], [3])
            result = STEPS[mode](acc, x, losses, counts)
            if rank == 0 and loss_logging == "next_step" and previous is not None:
                read.append(previous.loss.item())  # carried by this step's begin()
            elif rank == 0 and loss_logging == "end":
                read.append(result.loss.item())
            previous = result
        acc.flush()  # no-op unless a next_step loss waits
        if rank == 0 and loss_logging == "next_step":
            read.append(previous.loss.item())  # type: ignore[union-attr]
    return {"read": read, "collectives": dict(calls.calls)}


@protocol("rank0_reads/count_first/end")
def _reads_count_first(rank: int, group: dist.ProcessGroup) -> dict:
    return _rank0_reads(rank, group, "count_first", "end")


@protocol("rank0_reads/count_first/next_step")
def _reads_count_first_next(rank: int, group: dist.ProcessGroup) -> dict:
    return _rank0_reads(rank, group, "count_first", "next_step")


@protocol("rank0_reads/scale_after")
def _reads_scale_after(rank: int, group: dist.ProcessGroup) -> dict:
    return _rank0_reads(rank, group, "scale_after", "end")


def _nan_steps(rank: int, group: dist.ProcessGroup, mode: str) -> list[dict]:
    """Step 1: rank 0 has a NaN loss. Step 2: finite losses. Step 3: rank 0's NaN loss is in a
    microbatch of weight 0, which contributes nothing. Rank 1 is finite throughout."""
    acc = Accumulator(group=group, loss_reduction="mean")
    nan = math.nan
    steps = {
        0: [([nan, 1.0], [1, 2]), ([3.0, 1.0], [1, 2]), ([nan, 1.0], [0, 2])],
        1: [([2.0], [3]), ([2.0], [3]), ([2.0], [3])],
    }[rank]
    seen = []
    for losses, counts in steps:
        result = STEPS[mode](acc, _scalar(), losses, counts)
        seen.append({"nonfinite": bool(result.nonfinite_loss), "loss": result.loss.item()})
    return seen


@protocol("nan/count_first")
def _nan_count_first(rank: int, group: dist.ProcessGroup) -> list[dict]:
    return _nan_steps(rank, group, "count_first")


@protocol("nan/scale_after")
def _nan_scale_after(rank: int, group: dist.ProcessGroup) -> list[dict]:
    return _nan_steps(rank, group, "scale_after")


# The hardening scenarios: real DDP steps over the default group, checked against the
# single-process full-batch reference.


def _share(rank: int, world_size: int, weight_by: str, seed: int):
    """(the model, this rank's microbatches, the reference loss and gradients, the global
    token count) of one global batch: uneven microbatches, an empty one, and rank 1 holding
    no weight."""
    batch, sizes = global_batch(world_size, weight_by, seed)
    base = make_model(seed)
    expected_loss, expected_grads = reference(base, batch, weight_by)
    start, stop = split(batch.num_samples, [sum(s) for s in sizes])[rank]
    mine = batch.rows(start, stop)
    microbatches = [mine.rows(a, b) for a, b in split(stop - start, sizes[rank])]
    return base, microbatches, expected_loss, expected_grads, int(batch.num_tokens)


def _losses(model, microbatches, weight_by: str, loss_reduction: str) -> Iterator[tuple]:
    """Each microbatch and its loss, DDP syncing the gradients on the last one only; the caller
    back-propagates inside the loop."""
    for i, mb in enumerate(microbatches):
        with microbatch_context(model, "ddp", last=i == len(microbatches) - 1):
            yield mb, microbatch_loss(model, mb, weight_by, loss_reduction)


def ddp_step(model, acc: Accumulator, microbatches, weight_by: str, loss_reduction: str, mode):
    if mode == "count_first":
        acc.begin(
            num_tokens=[mb.num_tokens for mb in microbatches],
            num_samples=[mb.num_samples for mb in microbatches],
        )
        for _, loss in _losses(model, microbatches, weight_by, loss_reduction):
            acc.scale_loss(loss).backward()
    else:
        acc.begin(parameters=model.parameters())
        for mb, loss in _losses(model, microbatches, weight_by, loss_reduction):
            acc.scale_loss(loss, num_tokens=mb.num_tokens, num_samples=mb.num_samples).backward()
    return acc.end()


def _checked(result, model, expected_loss, expected_grads, expected_tokens) -> dict:
    return {
        "relative_error": max_relative_error(full_gradients(model), expected_grads),
        "loss": result.loss.item(),
        "expected_loss": expected_loss,
        "num_tokens": int(result.num_tokens),
        "expected_tokens": expected_tokens,
        "step": result.step,
    }


def _built_before_init(rank: int, world_size: int, acc: Accumulator, mode: str) -> dict:
    base, microbatches, *expected = _share(rank, world_size, "tokens", seed=31)
    model = wrap(copy.deepcopy(base), "ddp", world_size, "mean")
    result = ddp_step(model, acc, microbatches, "tokens", "sum", mode)
    return _checked(result, model, *expected)


def _refilled_buffers(rank: int, world_size: int, mode: str) -> dict:
    """The tensors that held the counts are refilled with other numbers right after each
    call that took them: the step must not see it."""
    base, microbatches, *expected = _share(rank, world_size, "tokens", seed=32)
    model = wrap(copy.deepcopy(base), "ddp", world_size, "mean")
    acc = Accumulator(loss_reduction="mean")
    if mode == "count_first":
        token_buffer = torch.stack([mb.num_tokens for mb in microbatches])
        sample_buffer = torch.tensor([mb.num_samples for mb in microbatches])
        acc.begin(num_tokens=token_buffer, num_samples=sample_buffer)
        token_buffer.fill_(1000)
        sample_buffer.zero_()
        for _, loss in _losses(model, microbatches, "tokens", "mean"):
            acc.scale_loss(loss).backward()
    else:
        n = torch.zeros((), dtype=torch.int64)  # one buffer for every microbatch's count
        s = torch.zeros((), dtype=torch.int64)
        acc.begin(parameters=model.parameters())
        for mb, loss in _losses(model, microbatches, "tokens", "mean"):
            n.fill_(mb.num_tokens)
            s.fill_(mb.num_samples)
            scaled = acc.scale_loss(loss, num_tokens=n, num_samples=s)
            n.fill_(1000)
            s.zero_()
            scaled.backward()
    result = acc.end()
    checked = _checked(result, model, *expected)
    checked["num_samples"] = int(result.num_samples)
    return checked


class SimulatedOutOfMemory(RuntimeError):
    pass


def _abandoned_everywhere(rank: int, world_size: int, mode: str) -> dict:
    """Every rank fails step 1 half-way inside ``with acc.begin(...)``, then runs step 2."""
    base, microbatches, *expected = _share(rank, world_size, "samples", seed=33)
    model = wrap(copy.deepcopy(base), "ddp", world_size, "mean")
    acc = Accumulator(loss_reduction="mean", weight_by="samples")
    try:
        # Counts unlike step 2's, so that any leak into step 2 would show in its gradient.
        started = (
            acc.begin(num_samples=[7, 1, 1])
            if mode == "count_first"
            else acc.begin(parameters=model.parameters())
        )
        with started, model.no_sync():
            first = microbatch_loss(model, microbatches[0], "samples", "mean")
            if mode == "count_first":
                acc.scale_loss(first).backward()
            else:
                acc.scale_loss(first, num_samples=7).backward()
            raise SimulatedOutOfMemory("microbatch 2 of step 1")
    except SimulatedOutOfMemory:
        pass
    still_open = acc.step_open
    model.zero_grad(set_to_none=True)
    result = ddp_step(model, acc, microbatches, "samples", "mean", mode)
    checked = _checked(result, model, *expected)
    checked["step_open_after_the_exception"] = still_open
    return checked


def _state_from_one_process(rank: int, world_size: int, acc: Accumulator, mode: str) -> dict:
    """``acc`` continues a run of 2 steps at world size 1 (see one_process_run)."""
    estimate = acc.state_dict()["weight_estimate"]
    base, microbatches, *expected = _share(rank, world_size, "tokens", seed=34)
    model = wrap(copy.deepcopy(base), "ddp", world_size, "mean")
    result = ddp_step(model, acc, microbatches, "tokens", "sum", mode)
    checked = _checked(result, model, *expected)
    checked["estimate_before"] = estimate
    checked["estimate_after"] = acc.state_dict()["weight_estimate"]
    return checked


def run_all(rank: int, world_size: int, states: dict[str, str], pickled: Accumulator) -> dict:
    """Every scenario, in one launch run with ``init_group=False``: two Accumulators are built
    before the process group exists (and ``pickled``, built in the test process, was
    unpickled before it too). The hardening scenarios reduce over the default group, then each
    protocol scenario over a group of its own."""
    early = {mode: Accumulator(loss_reduction="sum") for mode in STEPS}
    initialized_early = dist.is_initialized()
    gloo.init_process_group()
    hardening: dict[str, Any] = {"initialized_before_init": initialized_early}

    def loaded(mode: str) -> Accumulator:
        acc = Accumulator(loss_reduction="sum", weight_estimate=40.0)
        acc.load_state_dict(torch.load(states[mode], weights_only=True))
        return acc

    for mode in STEPS:
        hardening[f"built_before_init/{mode}"] = _attempt(
            lambda mode=mode: _built_before_init(rank, world_size, early[mode], mode)
        )
        hardening[f"refilled_buffers/{mode}"] = _attempt(
            lambda mode=mode: _refilled_buffers(rank, world_size, mode)
        )
        hardening[f"abandoned_everywhere/{mode}"] = _attempt(
            lambda mode=mode: _abandoned_everywhere(rank, world_size, mode)
        )
        hardening[f"state_from_one_process/{mode}"] = _attempt(
            lambda mode=mode: _state_from_one_process(rank, world_size, loaded(mode), mode)
        )
    hardening["pickled_from_one_process/scale_after"] = _attempt(
        lambda: _state_from_one_process(rank, world_size, pickled, "scale_after")
    )
    protocol = {}
    for name, scenario in PROTOCOL.items():
        group = dist.new_group(backend="gloo")
        protocol[name] = _attempt(lambda scenario=scenario, group=group: scenario(rank, group))
    hardening["pending_then_new_world"] = _attempt(lambda: _pending_then_new_world(rank))
    return {"hardening": hardening, "protocol": protocol}


# ---------------------------------------------------------------------------------------------
# The tests
# ---------------------------------------------------------------------------------------------


def one_process_run(mode: str) -> tuple[Accumulator, float]:
    """Two steps at world size 1, in the test process, with weight_estimate=40 (what the
    first scale-after step's provisional factors assume); returns the Accumulator and the
    largest gradient error of the two steps."""
    assert not dist.is_initialized()
    acc = Accumulator(loss_reduction="sum", weight_estimate=40.0)
    error = 0.0
    for seed in (35, 36):
        batch, _ = global_batch(2, "tokens", seed)
        model = make_model(seed)
        _, expected = reference(model, batch, "tokens")
        microbatches = [batch.rows(a, b) for a, b in split(batch.num_samples, [2, 0, 3, 2])]
        if mode == "count_first":
            acc.begin(num_tokens=[mb.num_tokens for mb in microbatches])
        else:
            acc.begin(parameters=model.parameters())
        for mb in microbatches:
            loss = microbatch_loss(model, mb, "tokens", "sum")
            counts = {} if mode == "count_first" else {"num_tokens": mb.num_tokens}
            acc.scale_loss(loss, **counts).backward()
        acc.end()
        error = max(error, max_relative_error([p.grad for p in model.parameters()], expected))
    return acc, error


@pytest.fixture(scope="module")
def launch(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The one-process runs here, then every scenario in one launch of 2 ranks (about 10 s on
    2 cores, mostly the start-up of the processes)."""
    folder = tmp_path_factory.mktemp("states")
    states, saved, errors = {}, {}, {}
    for mode in STEPS:
        acc, errors[mode] = one_process_run(mode)
        saved[mode] = acc.state_dict()
        states[mode] = str(folder / f"{mode}.pt")
        torch.save(saved[mode], states[mode])
    pickled, _ = one_process_run("scale_after")
    ranks = gloo.values(gloo.run_ranks(2, run_all, states, pickled, init_group=False, deadline=40))
    return {"ranks": ranks, "saved": saved, "one_process_errors": errors}


@pytest.fixture(scope="module")
def protocol_runs(launch: dict) -> list[dict]:
    return [ranks["protocol"] for ranks in launch["ranks"]]


@pytest.fixture(scope="module")
def hardening_runs(launch: dict) -> dict:
    return {**launch, "ranks": [ranks["hardening"] for ranks in launch["ranks"]]}


def _message(record: dict, rank: int, name: str) -> str:
    # A rank that waited for a collective until gloo's timeout would raise gloo's RuntimeError.
    assert record.get("error") == "DisagreementError" and record["lossweight's"], (
        f"{name}, rank {rank}: expected a lossweight.DisagreementError, got {record}"
    )
    return record["message"]


def _fine(record: dict, rank: int, name: str) -> Any:
    assert "error" not in record, f"{name}, rank {rank} raised: {record}"
    return record["values"]


# For each disagreement: the option that differs (None: the step or the call), and what each
# rank's message must say.
DISAGREEMENTS = {
    "weight_by": (
        "their loss terms",
        [
            ["this rank's are 'loss' (mean, by 'tokens');"],
            ["this rank's are 'loss' (mean, by 'samples');"],
        ],
    ),
    "loss_reduction": (
        "their loss terms",
        [
            ["this rank's are 'loss' (mean, by 'tokens');"],
            ["this rank's are 'loss' (sum, by 'tokens');"],
        ],
    ),
    "term_names": (
        "their loss terms",
        [
            ["this rank's are 'lm' (sum, by 'tokens'), 'aux' (mean, by 'samples');"],
            ["this rank's are 'lm' (sum, by 'tokens'), 'kl' (mean, by 'samples');"],
        ],
    ),
    "term_count": (
        "their loss terms",
        [
            ["this rank's are 'lm' (sum, by 'tokens');"],
            ["this rank's are 'lm' (sum, by 'tokens'), 'aux' (mean, by 'samples');"],
        ],
    ),
    "grad_reduction": (
        "grad_reduction",
        [
            ["this rank's factors undo a division of the gradients by 2, another rank's by"],
            ["this rank's factors undo a division of the gradients by 1, another rank's by"],
        ],
    ),
    "loss_logging": (
        "loss_logging",
        [["this rank has 'end'; 50% of the ranks have 'next_step'"], ["this rank has 'next_step'"]],
    ),
    "mode": (
        None,
        [
            ["this rank reduces for begin() of a count-first step"],
            ["this rank reduces for end() of a scale-after step"],
        ],
    ),
    "abandoned_alone/count_first": (
        None,
        [
            [
                "this rank is at step 3 but the ranks' mean step is 2.5",
                "abandoned",
                "this rank reduces for begin() of a count-first step",
            ],
            [
                "this rank is at step 2 but the ranks' mean step is 2.5",
                "this rank reduces for end() of a count-first step (to reduce its loss)",
            ],
        ],
    ),
    "abandoned_alone/scale_after": (
        None,
        [
            ["this rank is at step 3 but the ranks' mean step is 2.5", "abandoned"],
            ["this rank is at step 2 but the ranks' mean step is 2.5"],
        ],
    ),
    "extra_step": (
        None,
        [
            [
                "this rank is at step 2 but the ranks' mean step is 2.5",
                "this rank reduces for flush()",
            ],
            ["this rank is at step 3 but the ranks' mean step is 2.5", "added a step alone"],
        ],
    ),
    "idle_rank_counts_first": (
        None,
        [
            [
                "this rank reduces for begin() of a count-first step",
                "call begin(parameters=...) and end() as the other ranks do",
            ],
            [
                "this rank reduces for end() of a scale-after step",
                "call begin(parameters=...) and end() as the other ranks do",
            ],
        ],
    ),
    "weight_estimate": (
        None,
        [
            ["the ranks differ in the estimate of W", "this rank's is 1.0;"],
            ["the ranks differ in the estimate of W", "this rank's is 1000.0;"],
        ],
    ),
    "weight_estimate/reduced": (
        None,
        [
            ["the ranks differ in the estimate of W", "reduced, or 1.0 where that is 0;"],
            ["the ranks differ in the estimate of W", "reduced, or 1000.0 where that is 0;"],
        ],
    ),
    "max_grad_norm": (
        None,
        [
            ["the ranks differ in end(max_grad_norm=...)", "this rank's is 0.5,"],
            ["the ranks differ in end(max_grad_norm=...)", "this rank's is None,"],
        ],
    ),
    "abandoned_alone/next_step": (
        None,
        [
            ["50% of the ranks' reductions carry the loss", "and this rank's does not"],
            ["50% of the ranks' reductions carry the loss", "and this rank's does:"],
        ],
    ),
    **{
        f"skipped_iteration_{skipped}": (
            None,
            [
                [f"this rank is at step {skipped} but the ranks' mean step is {skipped + 0.5:g}"],
                [f"this rank is at step {skipped + 1} but the ranks' mean step is"],
            ],
        )
        for skipped in (1, 2, 3)
    },
}


@pytest.mark.parametrize("name", DISAGREEMENTS)
def test_ranks_that_disagree_all_raise_and_are_told_what_differs(
    protocol_runs: list[dict], name: str
) -> None:
    option, expected = DISAGREEMENTS[name]
    for rank, runs in enumerate(protocol_runs):
        message = _message(runs[name], rank, name)
        assert message.startswith("lossweight step "), message
        for fragment in expected[rank]:
            assert fragment in message, f"{name}, rank {rank}: {fragment!r} not in {message!r}"
        for other in OPTIONS:
            differs = f"differ in {other}" in message
            assert differs == (other == option), f"{name}, rank {rank}: {message!r}"
        if option is not None:
            assert "mean step" not in message and "call code" not in message, message


def test_a_destroyed_group_is_named(protocol_runs: list[dict]) -> None:
    for runs in protocol_runs:
        record = runs["destroyed_group"]
        assert record.get("error") == "RuntimeError", record
        assert "was destroyed (torch.distributed.destroy_process_group())" in record["message"]


def test_a_waiting_loss_is_never_reduced_in_another_world(hardening_runs: dict) -> None:
    # The default group is torn down while a loss waits: the next begin() (now in a world of
    # one) refuses to reduce it there, naming flush(); the step's result says why its loss is
    # gone; the run then goes on in its new world.
    for rank, runs in enumerate(hardening_runs["ranks"]):
        seen = _fine(runs["pending_then_new_world"], rank, "pending_then_new_world")
        refused, unreduced = seen["refused"], seen["unreduced"]
        assert refused.get("error") == "RuntimeError", seen
        assert "over another one, of 1 ranks" in refused["message"], seen
        assert (
            "call flush() on every rank before tearing a process group down" in refused["message"]
        )
        assert unreduced.get("error") == "RuntimeError", seen
        assert (
            "the loss of step 1 will never be reduced: the process group changed"
            in (unreduced["message"])
        )
        assert seen["after"] == {"values": 2, "seconds": seen["after"]["seconds"]}, seen
        # Neither the Accumulator nor the result keeps the destroyed default group alive.
        assert seen["held"] is False, seen


def test_a_rank_with_one_step_more_in_all_pairs_by_index_then_times_out() -> None:
    # The documented limit of step indices (docs/distributed.md, "Ranks that disagree"): they count
    # begin() calls, so a rank that re-runs a batch as a step of its own, with nothing else
    # different, is paired with the others' next step, as DDP's gradient all-reduce would pair
    # it; rank 0's steps 2 and 3 then weight rank 1's batches 1 and 2 correctly by their
    # counts. Only rank 1's last reduction has no partner, and the process group's timeout
    # ends it (3 s here) rather than a hang.
    outcomes = gloo.run_ranks(2, one_extra_step, collective_timeout=3, deadline=25)
    report = "\n".join(outcome.describe() for outcome in outcomes)
    assert outcomes[0].error is None, report
    losses = [seen["loss"] for seen in outcomes[0].value]
    assert losses == pytest.approx([1.0, (2 * 2 + 1 * 1) / 3, (3 * 3 + 2 * 2) / 5]), report
    assert outcomes[1].error is not None and outcomes[1].error != "DisagreementError", report
    assert "Timed out" in outcomes[1].message or "timeout" in outcomes[1].message.lower(), report


def test_the_same_divisor_given_two_ways_agrees(protocol_runs: list[dict]) -> None:
    # Rank 0: mean losses 1 and 3 over 1 and 2 tokens; rank 1: 3 over 2 tokens. The loss is
    # (1 + 6 + 6) / 5; the gradient of x, averaged over the ranks, is the same number.
    for rank, runs in enumerate(protocol_runs):
        seen = _fine(runs["same_divisor_spelled_differently"], rank, "same divisor")
        assert seen["loss"] == pytest.approx(13 / 5, rel=1e-15)
    grads = [runs["same_divisor_spelled_differently"]["values"]["grad"] for runs in protocol_runs]
    assert sum(grads) / 2 == pytest.approx(13 / 5, rel=1e-15)


@pytest.mark.parametrize(
    ("name", "step_collectives"),
    [
        ("rank0_reads/count_first/end", 6),
        ("rank0_reads/count_first/next_step", 4),  # 3 begin() and the flush()
        ("rank0_reads/scale_after", 3),
    ],
)
def test_rank_0_alone_reads_the_right_losses(
    protocol_runs: list[dict], name: str, step_collectives: int
) -> None:
    rank0, rank1 = (_fine(runs[name], rank, name) for rank, runs in enumerate(protocol_runs))
    assert rank0["read"] == pytest.approx([2.0, 10 / 3, 14 / 3], rel=1e-15)
    assert rank1["read"] == []
    # Reading on one rank issued nothing: both ranks issued the collectives of the steps.
    assert rank0["collectives"] == rank1["collectives"] == {"all_reduce": step_collectives}


def test_an_idle_rank_that_scales_after_gives_the_global_step(protocol_runs: list[dict]) -> None:
    for rank, runs in enumerate(protocol_runs):
        seen = _fine(runs["idle_rank_scales_after"], rank, "idle rank")
        assert seen == {"loss": 6.0, "grad": 3.0, "num_tokens": 5}


@pytest.mark.parametrize("mode", STEPS)
def test_a_nan_loss_on_one_rank_is_flagged_on_every_rank(
    protocol_runs: list[dict], mode: str
) -> None:
    name = f"nan/{mode}"
    for rank, runs in enumerate(protocol_runs):
        nan_step, finite, zero_weight_nan = _fine(runs[name], rank, name)
        assert nan_step["nonfinite"] is True
        assert math.isnan(nan_step["loss"])
        # Rank 0: 3 x 1 token + 1 x 2 tokens, rank 1: 2 x 3 tokens, over 6 tokens.
        assert finite == {"nonfinite": False, "loss": pytest.approx(11 / 6, rel=1e-15)}
        # A NaN loss of weight 0 is left out: (1 x 2 + 2 x 3) / 5.
        assert zero_weight_nan == {"nonfinite": False, "loss": pytest.approx(8 / 5, rel=1e-15)}


HARDENING = [
    "built_before_init",
    "refilled_buffers",
    "abandoned_everywhere",
    "state_from_one_process",
]


@pytest.mark.parametrize("mode", STEPS)
@pytest.mark.parametrize("name", HARDENING)
def test_ddp_steps_give_the_reference(hardening_runs: dict, name: str, mode: str) -> None:
    key = f"{name}/{mode}"
    expected_step = {"abandoned_everywhere": 2, "state_from_one_process": 3}.get(name, 1)
    for rank, runs in enumerate(hardening_runs["ranks"]):
        seen = _fine(runs[key], rank, key)
        assert seen["relative_error"] < 1e-10, f"{key}, rank {rank}: {seen}"
        assert seen["loss"] == pytest.approx(seen["expected_loss"], rel=1e-12)
        assert seen["num_tokens"] == seen["expected_tokens"]
        assert seen["step"] == expected_step
        if name == "refilled_buffers":
            assert seen["num_samples"] == 7
        if name == "abandoned_everywhere":
            assert seen["step_open_after_the_exception"] is False


def test_the_accumulators_were_built_before_the_process_group(hardening_runs: dict) -> None:
    assert [runs["initialized_before_init"] for runs in hardening_runs["ranks"]] == [False, False]


@pytest.mark.parametrize("mode", STEPS)
def test_state_moves_from_one_process_to_two(hardening_runs: dict, mode: str) -> None:
    # At world size 1 the steps were right, and the estimate saved is the last step's weight.
    assert hardening_runs["one_process_errors"][mode] < 1e-10
    saved = hardening_runs["saved"][mode]
    assert saved["steps"] == 2
    last_batch, _ = global_batch(2, "tokens", 36)
    assert saved["weight_estimate"] == int(last_batch.num_tokens)
    for rank, runs in enumerate(hardening_runs["ranks"]):
        seen = _fine(runs[f"state_from_one_process/{mode}"], rank, mode)
        assert seen["estimate_before"] == saved["weight_estimate"]
        # The two-rank step assumed the one-process weight, then found its own.
        assert seen["estimate_after"] == seen["expected_tokens"] != saved["weight_estimate"]


def test_a_pickled_accumulator_continues_at_another_world_size(hardening_runs: dict) -> None:
    for rank, runs in enumerate(hardening_runs["ranks"]):
        seen = _fine(runs["pickled_from_one_process/scale_after"], rank, "pickled")
        assert seen["relative_error"] < 1e-10
        assert seen["step"] == 3
        assert seen["estimate_before"] == hardening_runs["saved"]["scale_after"]["weight_estimate"]


def test_an_explicit_collective_makes_an_accumulator_unpicklable() -> None:
    # The pickled Accumulator above reduces over the default group; one given a group or a
    # collective refuses to be pickled rather than lose it.
    acc = Accumulator(loss_reduction="sum", collective=SingleProcess())
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(acc)


def test_the_harness_kills_a_hung_rank_and_reports_every_rank() -> None:
    # Rank 0 raises at once, rank 1 sleeps: the launch ends once the ranks have made no
    # progress for its deadline, naming rank 1 as hung, with its stack, and what rank 0 raised.
    with pytest.raises(AssertionError) as failure:
        gloo.run_ranks(2, gloo.raise_or_hang, deadline=8)
    message = str(failure.value)
    assert "rank(s) [1] of 2 hung: still running after 8 s without progress, SIGKILLed" in message
    assert "in raise_or_hang" in message  # rank 1's stack when it was killed
    assert "rank 0 raised ValueError: rank 0 gives up" in message


def test_the_harness_waits_for_ranks_that_make_progress() -> None:
    # Ranks that compute for longer than the deadline are slow, not hung: a busy machine makes
    # every rank so, and the deadline counts time without progress.
    outcomes = gloo.run_ranks(2, gloo.busy_for, 4.0, deadline=2)
    assert gloo.values(outcomes) == [0, 1]


def test_the_harness_stops_at_once_when_a_rank_dies() -> None:
    with pytest.raises(AssertionError) as failure:
        gloo.run_ranks(2, gloo.abort_or_wait, deadline=30)
    message = str(failure.value)  # a death, not the deadline: no rank is called hung
    assert "hung" not in message
    assert "rank 1 died with signal SIGABRT before reporting an outcome" in message
    assert "rank(s) [0] still running then, SIGKILLed" in message
    assert "in abort_or_wait" in message  # the stacks of both ranks


def test_values_raise_with_every_failed_rank() -> None:
    outcomes = [
        gloo.Outcome(rank=0, value={"a": 1}),
        gloo.Outcome(rank=1, error="ValueError", message="bad", traceback="Traceback: here"),
    ]
    with pytest.raises(AssertionError, match="rank 1 raised ValueError: bad\nTraceback: here"):
        gloo.values(outcomes)
    assert gloo.values(outcomes[:1]) == [{"a": 1}]
