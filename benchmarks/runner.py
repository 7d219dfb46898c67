"""The measurement: every variant trains its copy of the model on the same steps, on 1 or more
ranks (gloo processes on the CPU, NCCL on GPUs), timed, then counted."""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from .meter import Meter
from .variants import VARIANTS, Variant
from .workload import GPT, make_microbatches

# Steps run after the timed ones, in which each variant's collectives and host syncs are
# counted: counting intercepts every tensor operation, which would distort the times.
COUNTED_STEPS = 2


def measure(rank: int, world_size: int, scratch: str, args: argparse.Namespace) -> None:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, args.threads // world_size))
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"file://{scratch}/init",
        rank=rank,
        world_size=world_size,
    )
    torch.manual_seed(args.seed)
    base = GPT(args.vocabulary, args.context, args.width, args.layers).to(device)
    variants = []
    for variant in VARIANTS:
        model = GPT(args.vocabulary, args.context, args.width, args.layers).to(device)
        model.load_state_dict(base.state_dict())
        variants.append(variant(DistributedDataParallel(model)))
    meter = Meter()
    times: dict[str, list[float]] = {v.name: [] for v in variants}
    run_steps(args, rank, device, variants, meter, times)
    if rank == 0:
        results = {}
        baseline = times[variants[0].name]
        for variant in variants:
            name = variant.name
            t = times[name]
            quartiles = statistics.quantiles(t, n=4)
            ratios = [a / b for a, b in zip(t, baseline, strict=True)]
            ratio_quartiles = statistics.quantiles(ratios, n=4)
            results[name] = {
                "median_ms": 1e3 * statistics.median(t),
                "p25_ms": 1e3 * quartiles[0],
                "p75_ms": 1e3 * quartiles[2],
                "ratio_to_baseline": statistics.median(ratios),
                "ratio_p25": ratio_quartiles[0],
                "ratio_p75": ratio_quartiles[2],
                **meter.per_step(name, variants[0].name),
            }
        Path(scratch, "results.json").write_text(json.dumps(results))
    # DDP keeps the process group in a reference cycle: free it first, or gloo's threads may
    # be torn down at interpreter exit and abort the process.
    del variants
    gc.collect()
    dist.destroy_process_group()


def run_steps(
    args: argparse.Namespace,
    rank: int,
    device: torch.device,
    variants: list[Variant],
    meter: Meter,
    times: dict[str, list[float]],
) -> None:
    """Warm-up steps, timed steps, then steps in which the meter counts (untimed)."""
    cuda = device.type == "cuda"
    timed = range(args.warmup, args.warmup + args.steps)
    for step in range(args.warmup + args.steps + COUNTED_STEPS):
        microbatches = make_microbatches(args, rank, step, device)
        order = variants[step % len(variants) :] + variants[: step % len(variants)]
        for variant in order:
            dist.barrier()
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            with meter.counting(variant.name) if step >= timed.stop else contextlib.nullcontext():
                variant.step(microbatches)
            variant.optimizer.step()
            variant.optimizer.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            if step in timed:
                times[variant.name].append(elapsed)


def run_ranks(world_size: int, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        mp.spawn(measure, args=(world_size, scratch, args), nprocs=world_size)
        return json.loads(Path(scratch, "results.json").read_text())
