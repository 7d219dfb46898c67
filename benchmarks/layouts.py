"""lossweight's collectives per step in each parallel layout, counted on 4 gloo processes.

Beyond plain data parallelism, a layout adds ranks that hold slices of the same sequences
(context parallel), the same data (tensor parallel) or other parts of the model (pipeline
stages). lossweight gives none of them a collective of its own: the step's one reduction spans
the ranks it must, a tensor-parallel group's agreement check rides in it (16 bytes per group),
and the pipeline's stages share it, so that the last stage's totals reach every stage with no
broadcast. This counts it, for each mode, on every rank, in the third of three steps: the
collectives where they reach the process group, their bytes, and the host syncs, as
``benchmarks.meter`` counts them for the step-time table::

    .venv/bin/python -m benchmarks.layouts

Only lossweight's own calls are counted (``begin()`` to ``end()`` and the logged loss): the
wrappers' gradient reductions and the schedule's activations are the model's, the same with or
without lossweight.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

import lossweight

from .meter import Meter
from .report import layouts_markdown

WORLD_SIZE = 4
STEPS = 3
MODES = ("count first", "count first, loss in end()", "scale after")


def _plain() -> tuple[object, dict[str, object], bool]:
    return None, {}, True


def _dp_cp() -> tuple[object, dict[str, object], bool]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    return mesh["dp", "cp"], {}, True


def _dp_tp() -> tuple[object, dict[str, object], bool]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    return mesh["dp"], {}, True


def _pp_dp() -> tuple[object, dict[str, object], bool]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    return mesh["pp", "dp"], {"pipeline": "pp"}, mesh["pp"].get_local_rank() == 1


# Each layout: the group, the Accumulator's other options, and whether this rank computes the
# loss (every rank but a pipeline's earlier stages).
LAYOUTS: dict[str, Callable[[], tuple[object, dict[str, object], bool]]] = {
    "dp 4 (a process group)": _plain,
    "dp 2 x cp 2": _dp_cp,
    "dp 2 x tp 2": _dp_tp,
    "pp 2 x dp 2": _pp_dp,
}


def layout_collectives() -> dict[str, dict[str, dict]]:
    """Per layout and mode: the collectives, bytes and host syncs of lossweight's step, as
    one figure if every rank's was the same, else per rank."""
    with tempfile.TemporaryDirectory() as scratch:
        mp.spawn(_count, args=(scratch,), nprocs=WORLD_SIZE)
        return combined(
            [json.loads(Path(scratch, f"{rank}.json").read_text()) for rank in range(WORLD_SIZE)]
        )


def combined(per_rank: list[dict]) -> dict[str, dict[str, dict]]:
    """The ranks' figures (``rank_figures``) as one table: a figure where every rank's was the
    same, else every rank's."""
    return {
        layout: {mode: _one_figure([ranks[layout][mode] for ranks in per_rank]) for mode in MODES}
        for layout in LAYOUTS
    }


def _one_figure(figures: list[dict]) -> dict:
    return figures[0] if all(f == figures[0] for f in figures) else {"per rank": figures}


def _count(rank: int, scratch: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{scratch}/init", rank=rank, world_size=WORLD_SIZE
    )
    Path(scratch, f"{rank}.json").write_text(json.dumps(rank_figures(rank, WORLD_SIZE)))
    dist.destroy_process_group()


def rank_figures(rank: int, world_size: int) -> dict[str, dict]:
    """This rank's figures per layout and mode, in a default process group of 4 ranks."""
    assert world_size == WORLD_SIZE
    torch.set_num_threads(1)
    parameter = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    figures: dict[str, dict] = {}
    meter = Meter()
    for layout, place in LAYOUTS.items():
        group, options, computes_loss = place()
        # Uneven data: a count that the ranks of a tensor-parallel group share (they hold the
        # same data), and an empty microbatch.
        counts = [3 + (rank // 2 if layout == "dp 2 x tp 2" else rank), 0]
        figures[layout] = {}
        for mode in MODES:
            acc = lossweight.Accumulator(
                loss_reduction="sum",
                group=group,
                loss_logging="next_step" if mode == "count first" else "end",
                **options,  # type: ignore[arg-type]
            )
            result = None
            for _ in range(STEPS - 1):
                result = _step(acc, parameter, counts, mode, computes_loss, result)
            with meter.counting(f"{layout}, {mode}"):
                _step(acc, parameter, counts, mode, computes_loss, result)
            seen = meter.per_step(f"{layout}, {mode}", f"{layout}, {mode}")
            figures[layout][mode] = {
                "calls": seen["all_collectives_per_step"],
                "bytes": seen["all_bytes_per_step"],
                "host_syncs": seen["host_reads_per_step"],
            }
            acc.abandon()
    return figures


def _step(
    acc: lossweight.Accumulator,
    parameter: torch.nn.Parameter,
    counts: list[int],
    mode: str,
    computes_loss: bool,
    last: lossweight.StepResult | None,
) -> lossweight.StepResult:
    """One step, and its loss read as a trainer logs it: this step's, or with
    ``loss_logging="next_step"`` the last step's, which came with this step's reduction."""
    parameter.grad = None
    if mode == "scale after":
        acc.begin(parameters=[parameter])
    else:  # a pipeline's earlier stage counts nothing: zeros
        acc.begin(num_tokens=counts if computes_loss else [0] * len(counts))
    for count in counts if computes_loss else []:
        given = {"num_tokens": count} if mode == "scale after" else {}
        acc.scale_loss((parameter * count).sum(), **given).backward()
    result = acc.end()
    logged = last if acc.options.loss_logging == "next_step" else result
    if logged is not None:
        logged.loss.clone()
    return result


if __name__ == "__main__":
    print(layouts_markdown(layout_collectives()))
