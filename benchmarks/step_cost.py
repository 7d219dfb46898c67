"""What loss weighting costs per optimizer step, measured in one run.

lossweight beside a plain loop and other trainers' patterns, with the variants interleaved:

    .venv/bin/python -m benchmarks.step_cost              # 1 and 2 ranks (NCCL on a GPU)
    .venv/bin/python -m benchmarks.step_cost --steps 10   # a quick look
    .venv/bin/python -m benchmarks.step_cost --micro      # only lossweight's own time
    .venv/bin/python -m benchmarks.step_cost --json benchmarks/results.json   # save the record

Every variant trains its own copy of the same small GPT-style model on the same padded batches,
under DDP, with the same optimizer. For each step index the variants run one after the other,
in an order that rotates from step to step, so that slow phases of a noisy machine hit them
all alike. Reported per variant:

- the median step time, its 25th-75th percentile spread, and the median of its step-by-step
  ratio to the baseline step of the same index;
- the collectives it issues per step beyond the baseline's (DDP's gradient all-reduce), counted
  where they reach the process group (``lossweight.testing.count_collectives``) in steps run
  after the timed ones, and the bytes each rank contributes to them;
- the host syncs per step of its weighting and logging code, counted in the same steps: on the
  CPU the Tensor methods that read a value back (``item``, ``tolist``, ``__bool__``,
  ``__float__``, ``__int__``, ``__index__``); on a GPU also by
  ``torch.cuda.set_sync_debug_mode``.

Then lossweight's own collectives per step in each parallel layout on 4 gloo processes (data,
context, tensor and pipeline parallel; ``benchmarks.layouts``), in each mode.

The variants re-create other trainers' per-step patterns from their documented math (the
collectives, syncs and gradient passes listed in the project's notes), not their code:

- ``baseline``: ``loss / accumulation_steps`` (wrong weighting; the cost floor), and the same
  again as an A/A control, whose ratio to the baseline is the noise of the measurement;
- ``lossweight count-first``: ``Accumulator`` with ``loss_logging="next_step"`` (the loss
  of each step rides on the next step's count reduction);
- ``lossweight count-first, 2 terms`` and ``4 terms``: the same, with the loss split into
  terms of their own normalisers (tokens, sequences, a float weight sum, a constant): one
  collective per step still, and a payload 32 bytes longer per term;
- ``lossweight count-first, loss in end()``: the default ``loss_logging="end"`` (one more
  all-reduce, started by ``end()``, so the loss is ready when the step ends);
- ``lossweight scale-after``: ``Accumulator`` with counts given per microbatch;
- ``HF Trainer pattern``: an all-gather of the counts, an isnan check per microbatch, and an
  all-gather of the rank losses to log their mean;
- ``Composer pattern``: an all-reduce of the count read with ``.item()``, then one all-reduce
  and one ``.item()`` per loss key (one key here);
- ``torchtune pattern``: backward of ``loss_sum``, an all-reduce of the count and one of the
  loss, a foreach pass scaling the gradients, and ``.item()`` to log.

Every variant produces the step's logged loss every step, since that is what a trainer does.

The modules: ``workload`` (the model and the batches), ``variants`` (the patterns compared),
``runner`` (the timed and counted steps on each rank), ``meter`` (the counting), ``overhead``
(lossweight's own time, in one process), ``layouts`` (its collectives in each parallel layout),
``report`` (the tables); this one is the command line.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
from pathlib import Path

import torch

import lossweight

from .layouts import layout_collectives
from .overhead import call_overhead, group_overhead, walk_overhead
from .report import markdown, targets
from .runner import run_ranks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=40, help="measured steps per variant")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--rows", type=int, default=8, help="sequences per microbatch")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--vocabulary", type=int, default=512)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--micro", action="store_true", help="only lossweight's own time")
    parser.add_argument(
        "--json",
        type=Path,
        default=None,
        help="also write the record as JSON to this path (benchmarks/results.json is the "
        "committed one); by default nothing is written",
    )
    args = parser.parse_args()

    overhead = call_overhead(args)
    overhead["group_per_step_us"] = group_overhead(2)
    overhead["walk"] = walk_overhead(args)
    results = {} if args.micro else {n: run_ranks(n, args) for n in args.ranks}
    layouts = {} if args.micro else layout_collectives()
    device = (
        torch.cuda.get_device_name()
        if torch.cuda.is_available()
        else platform.processor() or platform.machine()
    )
    record = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{device}, {torch.get_num_threads()} threads",
        "torch": torch.__version__,
        "lossweight": lossweight.__version__,
        "settings": {k: v for k, v in vars(args).items() if k != "json"},
        "steps": results,
        "overhead": overhead,
        "layouts": layouts,
    }
    if args.json is not None:
        args.json.write_text(json.dumps(record, indent=2, default=str) + "\n")
    print(f"{record['date']}, {record['machine']}, torch {record['torch']}\n")
    print(markdown(results, overhead, layouts))
    for line in targets(results, overhead) if results else []:
        print(line)


if __name__ == "__main__":
    main()
