"""lossweight's own cost, per call and per step without a model: in one process, and on gloo
processes with their real reductions."""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import timeit
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lossweight import Accumulator, StepResult, _torch

from .workload import GPT, token_mean_loss


def call_overhead(args: argparse.Namespace, calls: int = 20_000, repeats: int = 5) -> dict:
    """Microseconds per call of the per-microbatch methods, beside the division they replace,
    and the library's own time for a whole step of ``args.microbatches`` microbatches (one
    process: the all-reduce is a no-op), with scale-after's gradient pass over the model."""
    loss = torch.tensor(2.5, requires_grad=True)
    count_first = Accumulator(loss_reduction="sum")
    count_first.begin(num_tokens=[7] * (calls * repeats + 1))
    count_first.scale_loss(loss)  # waits for the (single-process) reduction once
    scale_after = Accumulator(loss_reduction="sum")
    scale_after.begin(parameters=[loss])
    count = torch.tensor(7)

    def best(statement: Callable[[], object], number: int = calls) -> float:
        return 1e6 * min(timeit.repeat(statement, number=number, repeat=repeats)) / number

    per_call = {
        "loss / k (baseline)": best(lambda: loss / 4),
        "scale_loss(loss), count first": best(lambda: count_first.scale_loss(loss)),
        "backward_scale(0), count first": best(lambda: count_first.backward_scale(0)),
        "scale_loss(loss, num_tokens=tensor), scale after": best(
            lambda: scale_after.scale_loss(loss, num_tokens=count)
        ),
        "scale_loss(loss, num_tokens=int), scale after": best(
            lambda: scale_after.scale_loss(loss, num_tokens=7)
        ),
    }
    model = GPT(args.vocabulary, args.context, args.width, args.layers)
    parameters = list(model.parameters())
    grads = [torch.ones_like(parameter) for parameter in parameters]
    counts = [torch.tensor(7)] * args.microbatches
    accs = {
        logging: Accumulator(loss_reduction="sum", loss_logging=logging)
        for logging in ("end", "next_step")
    }

    def count_first_step(acc: Accumulator) -> None:
        acc.begin(num_tokens=counts)
        for _ in counts:
            acc.scale_loss(loss)
        acc.end()

    def give_gradients() -> None:
        # What the step's backward passes would do: before begin() the gradients are None
        # (zero_grad(set_to_none=True)); afterwards they exist, for end() to rescale.
        for parameter, grad in zip(parameters, grads, strict=True):
            parameter.grad = grad

    def take_gradients() -> None:
        for parameter in parameters:
            parameter.grad = None

    def scale_after_step() -> None:
        take_gradients()
        accs["end"].begin(parameters=parameters)
        give_gradients()
        for c in counts:
            accs["end"].scale_loss(loss, num_tokens=c)
        accs["end"].end()

    def harness() -> None:
        take_gradients()
        give_gradients()

    per_step = {
        "count first, loss_logging='next_step'": best(
            lambda: count_first_step(accs["next_step"]), number=500
        ),
        "count first, loss_logging='end'": best(lambda: count_first_step(accs["end"]), number=500),
        "scale after": best(scale_after_step, number=500) - best(harness, number=500),
    }
    return {"per_call_us": per_call, "per_step_us": per_step}


def walk_overhead(args: argparse.Namespace, repeats: int = 5) -> dict:
    """A scale-after ``scale_loss()`` walks its loss's autograd graph for parameters not given
    to ``begin()``: its time for a GPT's loss, less its time for a loss without a graph, beside
    the GPT's forward and backward, at three depths (milliseconds per microbatch); and the
    counters of backward passes that a scale-after step keeps on each parameter given (made,
    called by one backward, removed: milliseconds per step of one microbatch)."""
    depths = (args.layers, 4 * args.layers, 16 * args.layers)
    return {f"{layers} layers": _walk(args, layers, repeats) for layers in depths}


def _walk(args: argparse.Namespace, layers: int, repeats: int) -> dict:
    model = GPT(args.vocabulary, args.context, args.width, layers)
    tokens = torch.randint(0, args.vocabulary, (args.rows, args.context))
    acc = Accumulator(loss_reduction="sum")
    acc.begin(parameters=model)
    loss, leaf = token_mean_loss(model, tokens, tokens), torch.tensor(2.5, requires_grad=True)

    def best(statement: Callable[[], object], number: int) -> float:
        return 1e3 * min(timeit.repeat(statement, number=number, repeat=repeats)) / number

    walk = best(lambda: acc.scale_loss(loss, num_tokens=7), 20)
    walk -= best(lambda: acc.scale_loss(leaf, num_tokens=7), 20)
    acc.abandon()
    parameters = list(model.parameters())

    def touch() -> None:  # a backward that reaches every parameter, and little else
        torch.stack([p.view(-1)[0] for p in parameters]).sum().backward()

    def counted() -> None:
        counters = _torch.Backwards(parameters)
        touch()
        counters.close()

    counters = best(counted, 20) - best(touch, 20)
    step = best(lambda: token_mean_loss(model, tokens, tokens).backward(), 1)
    return {"walk_ms": walk, "counters_ms": counters, "forward_backward_ms": step}


def group_overhead(world_size: int, steps: int = 2000, repeats: int = 5) -> dict:
    """lossweight's own time for a count-first step of 4 microbatches without a model, on
    ``world_size`` gloo processes: what ``overhead`` measures in one process, plus the real
    reductions (the count all-reduce that ``begin()`` starts and ``scale_loss()`` waits for,
    and ``end()``'s loss all-reduce). The best of ``repeats`` runs of ``steps`` steps, on
    rank 0, in microseconds per step."""
    with tempfile.TemporaryDirectory() as scratch:
        mp.spawn(_group_steps, args=(world_size, scratch, steps, repeats), nprocs=world_size)
        return json.loads(Path(scratch, "group.json").read_text())


def _group_steps(rank: int, world_size: int, scratch: str, steps: int, repeats: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{scratch}/init", rank=rank, world_size=world_size
    )
    counts = [torch.tensor(7)] * 4
    per_step = {}
    for logging in ("next_step", "end"):
        step = _LoggedStep(Accumulator(loss_reduction="sum", loss_logging=logging), counts)
        best = float("inf")
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                step()
            best = min(best, time.perf_counter() - start)
        step.acc.flush()
        per_step[f"count first, loss_logging={logging!r}, {world_size} ranks"] = 1e6 * best / steps
    if rank == 0:
        Path(scratch, "group.json").write_text(json.dumps(per_step))
    dist.destroy_process_group()


class _LoggedStep:
    """A count-first step without a model whose logged loss is read as a trainer reads it:
    the last step's with ``"next_step"`` (it came with this step's counts), this step's with
    ``"end"`` (a wait for end()'s all-reduce)."""

    def __init__(self, acc: Accumulator, counts: list[torch.Tensor]) -> None:
        self.acc, self.counts = acc, counts
        self.loss = torch.tensor(2.5, requires_grad=True)
        self.previous: StepResult | None = None
        self.logged: torch.Tensor | None = None

    def __call__(self) -> None:
        self.acc.begin(num_tokens=self.counts)
        for _ in self.counts:
            self.acc.scale_loss(self.loss)
        result = self.acc.end()
        logged = result if self.acc.options.loss_logging == "end" else self.previous
        if logged is not None:
            self.logged = logged.loss
        self.previous = result
