"""The training runs: every split with every method, in this process and on 2 gloo processes.

Each run starts from the same model on the same batches, so the runs differ only in how a step
is split and how its microbatches are weighted.
"""

from __future__ import annotations

import contextlib
import gc
import math
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .. import Accumulator, count_tokens, token_cross_entropy
from ..testing import InProcessGroup
from ..testing._checker import _relative_error
from .data import GLOO_SPLIT, SPLITS, inputs_and_labels, make_batches, microbatches
from .model import TinyLM

METHODS = ("naive", "lossweight")
Progress = Callable[[str, str], None]  # called with (split, method) after each step


@dataclass
class Run:
    """One split trained with one method."""

    split: str
    method: str
    losses: list[float] = field(default_factory=list)  # token-mean loss of each step's batch
    first_gradients: list[torch.Tensor] = field(default_factory=list)
    eval_loss: float = math.nan
    gradient_difference: float = math.nan  # to the reference, after the first step


def step_loss(model: nn.Module, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the summed next-token loss of ``rows``, its number of target tokens)."""
    tokens, labels = inputs_and_labels(rows)
    return token_cross_entropy(model(tokens), labels, shift=True)


def backward_microbatches(
    model: nn.Module, shard: list[torch.Tensor], method: str, acc: Accumulator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run one rank's microbatches of a step; return its detached loss sum and token count.

    The accumulator's step must be open when the method is lossweight.
    """
    loss_sum, tokens = torch.zeros(()), torch.zeros((), dtype=torch.int64)
    for index, rows in enumerate(shard):
        last = index == len(shard) - 1
        # DDP skips its gradient all-reduce on all but the last microbatch of a step.
        skip_sync = isinstance(model, DistributedDataParallel) and not last
        with model.no_sync() if skip_sync else contextlib.nullcontext():  # type: ignore[operator]
            summed, count = step_loss(model, rows)
            # Naive: the microbatch's mean, divided by the accumulation steps.
            loss = summed / count / len(shard) if method == "naive" else acc.scale_loss(summed)
            loss.backward()  # type: ignore[no-untyped-call]
        loss_sum, tokens = loss_sum + summed.detach(), tokens + count
    return loss_sum, tokens


def token_mean(model: nn.Module, rows: torch.Tensor) -> float:
    """The token-mean loss of ``rows``, without a gradient: how a run is scored on held-out data."""
    with torch.no_grad():
        summed, count = step_loss(model, rows)
    return float(summed / count)


def begin(acc: Accumulator, shard: list[torch.Tensor]) -> None:
    """Open the step with the target tokens of each microbatch, counted as the loss counts them."""
    acc.begin(num_tokens=[count_tokens(rows, shift=True) for rows in shard])


def finish_step(run: Run, model: nn.Module, optimizer: torch.optim.Optimizer, loss: float) -> None:
    """Record the step's loss (and the first step's gradient, to compare splits), then step."""
    if not run.first_gradients:
        run.first_gradients = [p.grad.detach().clone() for p in model.parameters()]  # type: ignore[union-attr]
    run.losses.append(loss)
    optimizer.step()
    optimizer.zero_grad()


def train_in_process(
    split: str,
    method: str,
    batches: list[torch.Tensor],
    held_out: torch.Tensor,
    seed: int,
    advance: Progress,
) -> Run:
    """Train on ranks simulated in this process; their gradients are averaged as DDP does."""
    torch.manual_seed(seed)
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    world_size = len(SPLITS[split])
    # Driven one rank after the other from this thread: every rank starts a reduction (in
    # begin() and end()) before any rank waits for it.
    group = InProcessGroup(world_size)
    accs = [
        Accumulator(weight_by="tokens", loss_reduction="sum", collective=group.collective(rank))
        for rank in range(world_size)
    ]
    run = Run(split, method)
    for batch in batches:
        shards = microbatches(batch, split)
        if method == "lossweight":
            for acc, shard in zip(accs, shards, strict=True):
                begin(acc, shard)
        loss_sum, tokens = torch.zeros(()), torch.zeros((), dtype=torch.int64)
        for acc, shard in zip(accs, shards, strict=True):
            rank_sum, rank_tokens = backward_microbatches(model, shard, method, acc)
            loss_sum, tokens = loss_sum + rank_sum, tokens + rank_tokens
            if method == "lossweight":
                acc.end()
        for parameter in model.parameters():  # the average over ranks that DDP would take
            assert parameter.grad is not None
            parameter.grad /= world_size
        finish_step(run, model, optimizer, float(loss_sum / tokens))
        advance(split, method)
    run.eval_loss = token_mean(model, held_out)
    return run


def gloo_worker(
    rank: int, world_size: int, scratch: str, seed: int, steps: int, messages: mp.SimpleQueue[str]
) -> None:
    """One real data-parallel rank: DDP over gloo, ``no_sync`` on all but the last microbatch.

    Rank 0 reports each step on ``messages`` and saves each finished run in ``scratch``.
    """
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{scratch}/init", rank=rank, world_size=world_size
    )
    batches, held_out = make_batches(seed, steps)
    for method in METHODS:
        torch.manual_seed(seed)
        model = DistributedDataParallel(TinyLM())
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        acc = Accumulator(weight_by="tokens", loss_reduction="sum")
        run = Run(GLOO_SPLIT, method)

        for batch in batches:
            shard = microbatches(batch, GLOO_SPLIT)[rank]
            if method == "lossweight":
                begin(acc, shard)
            loss_sum, tokens = backward_microbatches(model, shard, method, acc)
            if method == "lossweight":
                acc.end()
            totals = torch.stack([loss_sum.double(), tokens.double()])
            dist.all_reduce(totals)  # the true token-mean loss, for the table and the plot
            finish_step(run, model, optimizer, float(totals[0] / totals[1]))
            if rank == 0:
                messages.put(method)
        run.eval_loss = token_mean(model.module, held_out)
        if rank == 0:
            torch.save(run, Path(scratch, f"{method}.pt"))
    # DDP keeps the process group in a reference cycle: free it before destroying the group,
    # or gloo's threads may be torn down at interpreter exit and abort the process.
    del model, optimizer
    gc.collect()
    dist.destroy_process_group()


def train_gloo(seed: int, steps: int, advance: Progress) -> list[Run]:
    """Spawn the 2 gloo ranks and relay their progress while they train."""
    messages = mp.get_context("spawn").SimpleQueue()
    with tempfile.TemporaryDirectory() as scratch:
        processes = mp.start_processes(  # type: ignore[attr-defined,no-untyped-call]
            gloo_worker,
            args=(2, scratch, seed, steps, messages),
            nprocs=2,
            join=False,
            start_method="spawn",
        )
        finished = False
        while not finished:
            finished = processes.join(timeout=0.05)
            while not messages.empty():
                advance(GLOO_SPLIT, messages.get())
        return [torch.load(Path(scratch, f"{method}.pt"), weights_only=False) for method in METHODS]


def run_demo(steps: int, seed: int, progress: Progress | None = None) -> list[Run]:
    """Train every split with every method on the same batches; return the runs.

    The in-process runs are tiny: one thread is fastest for them, and stays fast on a machine
    whose other cores are busy (several threads would wait for one another there). The
    caller's thread count is restored afterwards.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run_demo(steps, seed, progress)
    finally:
        torch.set_num_threads(threads)


def _run_demo(steps: int, seed: int, progress: Progress | None) -> list[Run]:
    batches, held_out = make_batches(seed, steps)
    advance: Progress = progress or (lambda split, method: None)
    runs = []
    for split in SPLITS:
        if split == GLOO_SPLIT:
            runs += train_gloo(seed, steps, advance)
            continue
        for method in METHODS:
            runs.append(train_in_process(split, method, batches, held_out, seed, advance))
    reference = next(r for r in runs if r.split == "1 x 1" and r.method == "lossweight")
    for run in runs:
        # The largest difference relative to the reference's largest entry.
        run.gradient_difference = _relative_error(run.first_gradients, reference.first_gradients)[0]
    return runs
