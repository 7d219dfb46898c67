"""The DeepSpeed runs of tests/test_deepspeed.py: one 2-rank gloo world, every case in it.

Each case trains a small float32 model under a DeepSpeed engine with gradient accumulation
steps 3, through uneven windows: rows spread unevenly over ranks and microbatches, an empty
microbatch, a step where rank 1 has no row at all, and a short last window of 2 microbatches.
Each step's gradient, read before its ``engine.step()`` at the boundary, is compared with the
full-batch gradient of the step's rows (float64, one process). DeepSpeed keeps float32 master
gradients, so the comparison is at float32 precision.
"""

from __future__ import annotations

import copy
import logging
import warnings
from typing import Any

import torch

from .integration_workers import distributed_environment

ACCUMULATION = 3
# Rows per rank and microbatch, for each step of a run: the last window is short.
WINDOWS = [
    [[4, 0, 2], [1, 3, 5]],
    [[2, 6, 1], [0, 0, 0]],  # rank 1 has no row in this step
    [[3, 1], [2, 2]],  # a short last window
]
WIDTH = 4
# Large, so that the update of float32 weights carries the gradient to float32 precision.
LR = 1000.0


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(WIDTH, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)
    ).float()


def data(step: int, rank: int, microbatch: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + 100 * rank + microbatch)
    x = torch.randn(rows, WIDTH, generator=generator, dtype=torch.float64)
    return x, torch.randn(rows, generator=generator, dtype=torch.float64)


def references(base: torch.nn.Module, windows: list[list[list[int]]]) -> list[dict[str, Any]]:
    """Per step: the float64 mean squared error over all of its rows, and its gradient."""
    steps = []
    for step, ranks in enumerate(windows):
        reference = copy.deepcopy(base).double()
        total, count = torch.zeros((), dtype=torch.float64), 0
        for rank, microbatches in enumerate(ranks):
            for microbatch, rows in enumerate(microbatches):
                x, y = data(step, rank, microbatch, rows)
                total = total + ((reference(x).squeeze(-1) - y) ** 2).sum()
                count += rows
        (total / count).backward()
        grads = [p.grad.clone() for p in reference.parameters()]
        steps.append({"loss": float(total) / count, "grads": grads})
    return steps


def relative_error(got: list[torch.Tensor], expected: list[torch.Tensor]) -> float:
    """The largest difference, each tensor against its own largest entry (stricter than
    tests/problem.py's max_relative_error, whose one scale would hide a small bias's error)."""
    return max(
        float((g.double() - e).abs().max() / e.abs().max().clamp(min=1e-12))
        for g, e in zip(got, expected, strict=True)
    )


def engine_for(
    base: torch.nn.Module, stage: int, log_comms: bool = False, lr: float = 0.0, **extra: Any
) -> Any:
    import deepspeed

    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": ACCUMULATION,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,  # DeepSpeed clips to 1.0 by default
    }
    config.update(extra)
    if log_comms:  # DeepSpeed's own count of its collectives
        config["comms_logger"] = {"enabled": True, "prof_all": True, "verbose": False}
    net = copy.deepcopy(base)
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)  # lr 0: the same weights every step
    engine, *_ = deepspeed.initialize(model=net, optimizer=optimizer, config=config)
    return engine


def train(
    engine: Any,
    rank: int,
    backward: str,
    scale_after: bool,
    windows: list[list[list[int]]],
    read: bool = True,
    undo: bool = True,
) -> dict[str, Any]:
    """The documented loop; each step's full gradient before its last ``engine.step()``."""
    from deepspeed.utils import safe_get_full_grad

    from lossweight import Accumulator
    from lossweight.integrations.deepspeed import DeepSpeedAccumulator

    lw = DeepSpeedAccumulator(engine, loss_reduction="sum", weight_by="samples")
    if not undo:  # a plain Accumulator, which does not undo the engine's division
        lw = Accumulator(loss_reduction="sum", weight_by="samples")
    steps, losses = [], []
    for step, ranks in enumerate(windows):
        mine = ranks[rank]
        if scale_after:
            lw.begin(parameters=engine.module.parameters())
        else:
            lw.begin(num_samples=mine)
        for microbatch, rows in enumerate(mine):
            x, y = data(step, rank, microbatch, rows)
            loss = ((engine(x.float()).squeeze(-1).double() - y) ** 2).sum()
            scaled = lw.scale_loss(loss, num_samples=rows) if scale_after else lw.scale_loss(loss)
            if backward == "engine":
                engine.backward(scaled)
            else:
                scaled.backward()
            if engine.is_gradient_accumulation_boundary():
                result = lw.end()
                if read:  # gathering a full gradient is a collective of its own
                    steps.append([safe_get_full_grad(p) for p in engine.module.parameters()])
                losses.append(result.loss.item())
            engine.step()
    return {"grads": steps, "losses": losses}


def without_shared_memory_op() -> None:
    """Keep DeepSpeed from compiling its shared-memory all-reduce at start-up: a C++ build of
    a minute on a fresh machine, for an op that only its inference all-reduce uses (training
    reduces through torch.distributed, which these tests count)."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def run(rank: int, world_size: int) -> dict[str, Any]:
    distributed_environment(rank, world_size)
    warnings.filterwarnings("ignore")
    without_shared_memory_op()

    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    base = model()
    steps = references(base, WINDOWS)
    expected = [step["grads"] for step in steps]
    outcome: dict[str, Any] = {}
    cases = [(stage, backward) for stage in range(4) for backward in ("engine", "plain")]
    for stage, backward in cases:
        name = f"zero{stage}/{backward}"
        try:
            seen = train(engine_for(base, stage), rank, backward, False, WINDOWS)
        except RuntimeError as error:  # DeepSpeed refuses a plain backward at stage 0
            outcome[name] = {"error": str(error)}
            continue
        outcome[name] = {
            "errors": [relative_error(g, e) for g, e in zip(seen["grads"], expected, strict=True)],
            "losses": seen["losses"],
        }
    # DeepSpeed's own collectives over the two full windows, as its comms logger counts them,
    # in a loop without lossweight and in the same loop with it.
    from deepspeed.comm import comms_logger

    from lossweight.testing import count_collectives

    for stage in range(4):
        counted = {}
        for variant in ("deepspeed", "with_lossweight"):
            engine = engine_for(base, stage, log_comms=True)
            comms_logger.comms_dict = {}
            if variant == "deepspeed":
                plain_loop(engine, rank, WINDOWS[:2])
            else:
                train(engine, rank, "engine", False, WINDOWS[:2], read=False)
            counted[variant] = {
                name: sum(entry[0] for entry in sizes.values())
                for name, sizes in comms_logger.comms_dict.items()
            }
            comms_logger.enabled = False
        # Everything, lossweight's reductions included, as lossweight.testing counts it.
        for variant in ("all_plain", "all_with_lossweight"):
            engine = engine_for(base, stage)
            with count_collectives() as seen:
                if variant == "all_plain":
                    plain_loop(engine, rank, WINDOWS[:2])
                else:
                    train(engine, rank, "engine", False, WINDOWS[:2], read=False)
            counted[variant] = dict(seen.calls)
        outcome[f"zero{stage}/collectives"] = counted
    # The engine summing the ranks' gradients (gradient_allreduce_op "sum"); a step abandoned
    # after one backward, then the steps; a plain Accumulator, which leaves the division.
    variants = {
        "zero1/sum-allreduce": (engine_for(base, 1, gradient_allreduce_op="sum"), {}),
        "zero0/after-abandon": (engine_for(base, 0), {}),
        "zero2/not-undone": (engine_for(base, 2), {"undo": False}),
    }
    for name, (engine, options) in variants.items():
        if name.endswith("after-abandon"):
            abandon_one(engine, rank)
        seen = train(engine, rank, "engine", False, WINDOWS[:2], **options)
        pairs = zip(seen["grads"], expected[:2], strict=True)
        outcome[name] = [relative_error(g, e) for g, e in pairs]
    # Scaling after: windows of the accumulation steps, at stage 0.
    seen = train(engine_for(base, 0), rank, "engine", True, WINDOWS[:2])
    outcome["zero0/scale-after"] = {
        "errors": [relative_error(g, e) for g, e in zip(seen["grads"], expected[:2], strict=True)],
        "losses": seen["losses"],
    }
    outcome["expected_losses"] = [step["loss"] for step in steps]
    outcome["misuse"] = misuse(base, rank)
    return outcome


def abandon_one(engine: Any, rank: int) -> str:
    """Abandon a step after one backward; then what the next begin() says ("accepted")."""
    from lossweight.integrations.deepspeed import DeepSpeedAccumulator

    lw = DeepSpeedAccumulator(engine, loss_reduction="sum", weight_by="samples")
    lw.begin(num_samples=[2, 2, 2])
    x, y = data(9, rank, 0, 2)
    loss = ((engine(x.float()).squeeze(-1).double() - y) ** 2).sum()
    engine.backward(lw.scale_loss(loss))
    lw.abandon()
    try:
        lw.begin(num_samples=[1])
        lw.abandon()
        return "accepted"
    except RuntimeError as error:
        return str(error)


def plain_loop(engine: Any, rank: int, windows: list[list[list[int]]]) -> None:
    """The loop without lossweight: each microbatch's mean loss, DeepSpeed's own division."""
    for step, ranks in enumerate(windows):
        for microbatch, rows in enumerate(ranks[rank]):
            x, y = data(step, rank, microbatch, rows)
            loss = ((engine(x.float()).squeeze(-1).double() - y) ** 2).sum() / max(rows, 1)
            engine.backward(loss)
            engine.step()


def misuse(base: torch.nn.Module, rank: int) -> dict[str, str]:
    """The message of each misuse, or "accepted"."""
    from lossweight.integrations.deepspeed import DeepSpeedAccumulator

    found = {}
    engine = engine_for(base, 2)
    attempts = {
        "divides_given": lambda: DeepSpeedAccumulator(
            engine, loss_reduction="sum", framework_divides_loss_by=3
        ),
        "scale_after_zero2": lambda: DeepSpeedAccumulator(engine, loss_reduction="sum").begin(
            parameters=engine.module.parameters()
        ),
    }
    for name, attempt in attempts.items():
        try:
            attempt()
            found[name] = "accepted"
        except (ValueError, RuntimeError) as error:
            found[name] = str(error)
    # A scale-after step ended before the boundary (one microbatch of 3).
    engine = engine_for(base, 0)
    lw = DeepSpeedAccumulator(engine, loss_reduction="sum", weight_by="samples")
    lw.begin(parameters=engine.module.parameters())
    x, y = data(0, rank, 0, 2)
    engine.backward(
        lw.scale_loss(((engine(x.float()).squeeze(-1).double() - y) ** 2).sum(), num_samples=2)
    )
    try:
        lw.end()
        found["early_end"] = "accepted"
    except RuntimeError as error:
        found["early_end"] = str(error)
    # A count-first loop that scales with backward_scale(i) (the engine's boundary is its own
    # count then) over a short window of 2 microbatches of 3.
    engine = engine_for(base, 2)
    lw = DeepSpeedAccumulator(engine, loss_reduction="sum", weight_by="samples")
    lw.begin(num_samples=[2, 1])
    try:
        for microbatch, rows in enumerate([2, 1]):
            x, y = data(0, rank, microbatch, rows)
            loss = ((engine(x.float()).squeeze(-1).double() - y) ** 2).sum()
            engine.backward(loss * lw.backward_scale(microbatch))
            lw.record_loss(microbatch, loss)
            if microbatch == 0:
                engine.step()
        lw.end()
        found["short_window_by_hand"] = "accepted"
    except RuntimeError as error:
        found["short_window_by_hand"] = str(error)
    found["abandoned_zero2"] = abandon_one(engine_for(base, 2), rank)
    # scale_loss() compiled: it could not tell the engine where the step ends.
    lw = DeepSpeedAccumulator(engine_for(base, 2), loss_reduction="sum", weight_by="samples")
    lw.begin(num_samples=[1, 1, 1])
    compiled = torch.compile(lw.scale_loss, fullgraph=True)
    try:
        compiled(torch.ones((), dtype=torch.float64, requires_grad=True) * 2)
        found["compiled"] = "accepted"
    except Exception as error:  # dynamo may wrap it: the message is what counts
        found["compiled"] = str(error)
    # The accumulation steps changed under the Accumulator (a batch-size ramp).
    engine = engine_for(base, 1)
    lw = DeepSpeedAccumulator(engine, loss_reduction="sum", weight_by="samples")
    engine.set_train_batch_size(2 * 2)  # 2 ranks, 1 row a microbatch: 2 accumulation steps
    try:
        lw.begin(num_samples=[1, 1])
        found["steps_changed"] = "accepted"
    except ValueError as error:
        found["steps_changed"] = str(error)
    return found


def hf_run(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    """One optimizer step of LossweightTrainer under a DeepSpeed config (ZeRO 2), for a model
    whose forward takes the loss kwargs and one whose forward does not (transformers #45305):
    the step's gradient, read from the update of plain SGD, against the full batch."""
    distributed_environment(rank, world_size)
    from transformers import TrainingArguments

    from lossweight.integrations.hf import LossweightTrainer

    from . import integration_workers as hf

    without_shared_memory_op()
    rows = hf.hf_rows(world_size)
    models = hf.hf_models()
    outcome: dict[str, Any] = {}
    for name in ("llama", "no-loss-kwargs"):
        base = models[name].float()
        reference = hf.hf_reference(copy.deepcopy(base).double(), rows, False)[0]
        config = {
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto",
            "zero_optimization": {"stage": 2},
            "zero_allow_untested_optimizer": True,
        }
        args = TrainingArguments(
            output_dir=f"{tmp}/ds-{rank}",
            per_device_train_batch_size=hf.HF_ROWS,
            gradient_accumulation_steps=hf.HF_MICROBATCHES,
            max_steps=1,
            learning_rate=LR,
            lr_scheduler_type="constant",
            optim="sgd",
            weight_decay=0.0,
            max_grad_norm=0.0,
            deepspeed=config,
            train_sampling_strategy="sequential",
            remove_unused_columns=False,
            use_cpu=True,
            report_to=[],
            save_strategy="no",
            disable_tqdm=True,
        )
        model = copy.deepcopy(base)
        before = [p.detach().clone() for p in model.parameters()]
        trainer = LossweightTrainer(
            model=model, args=args, train_dataset=Rows(rows), data_collator=hf.HFCollator(False)
        )
        trainer.train()
        after = [p.detach().double() for p in trainer.model.parameters()]
        grads = [(b.double() - a) / LR for b, a in zip(before, after, strict=True)]
        outcome[name] = {
            "error": relative_error(grads, reference["grads"]),
            "loss": trainer.last_result.loss.item() if trainer.last_result else None,
            "expected_loss": reference["loss"],
        }
    return outcome


class Rows(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, rows: list[dict]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        return self.rows[index]


# ------------------------------------------------------------------------------------------
# Loops that stray from DeepSpeed's own count of microbatches, each step's update measured
# ------------------------------------------------------------------------------------------

SHORT_THEN_FULL = [[[3, 1], [2, 2]], WINDOWS[0]]
LONG_THEN_FULL = [[[1, 2, 1, 2], [2, 1, 1, 1]], WINDOWS[0]]


def loss_of(engine: Any, step: int, rank: int, microbatch: int, rows: int) -> torch.Tensor:
    x, y = data(step, rank, microbatch, rows)
    return ((engine(x.float()).squeeze(-1).double() - y) ** 2).sum()


def at_current_weights(engine: Any, base: torch.nn.Module, step: int, ranks: list) -> list:
    """The full-batch gradient of a window's rows at the engine's weights (stage 0 to 2 keep
    every parameter whole), float64."""
    reference = copy.deepcopy(base).double()
    with torch.no_grad():
        for mine, theirs in zip(reference.parameters(), engine.module.parameters(), strict=True):
            mine.copy_(theirs.double())
    total, count = torch.zeros((), dtype=torch.float64), 0
    for rank, microbatches in enumerate(ranks):
        for microbatch, rows in enumerate(microbatches):
            x, y = data(step, rank, microbatch, rows)
            total = total + ((reference(x).squeeze(-1) - y) ** 2).sum()
            count += rows
    (total / count).backward()
    return [p.grad for p in reference.parameters()]


def documented(engine: Any, lw: Any, step: int, rank: int, mine: list[int]) -> None:
    lw.begin(num_samples=mine)
    for microbatch, rows in enumerate(mine):
        engine.backward(lw.scale_loss(loss_of(engine, step, rank, microbatch, rows)))
        if engine.is_gradient_accumulation_boundary():
            lw.end()
        engine.step()


def end_after_step(engine: Any, lw: Any, step: int, rank: int, mine: list[int]) -> None:
    lw.begin(num_samples=mine)
    for microbatch, rows in enumerate(mine):
        engine.backward(lw.scale_loss(loss_of(engine, step, rank, microbatch, rows)))
        engine.step()
    lw.end()


def scale_after_end_after_step(engine: Any, lw: Any, step: int, rank: int, mine: list) -> None:
    lw.begin(parameters=engine.module.parameters())
    for microbatch, rows in enumerate(mine):
        loss = loss_of(engine, step, rank, microbatch, rows)
        engine.backward(lw.scale_loss(loss, num_samples=rows))
        engine.step()
    lw.end()


def scale_after_step_at_end(engine: Any, lw: Any, step: int, rank: int, mine: list) -> None:
    """Scaled after, each engine.step() off DeepSpeed's boundary right after its backward, the
    one at the boundary after end()."""
    lw.begin(parameters=engine.module.parameters())
    for microbatch, rows in enumerate(mine):
        loss = loss_of(engine, step, rank, microbatch, rows)
        engine.backward(lw.scale_loss(loss, num_samples=rows))
        if not engine.is_gradient_accumulation_boundary():
            engine.step()
    lw.end()
    engine.step()


def by_hand(engine: Any, lw: Any, step: int, rank: int, mine: list[int]) -> None:
    """Scaled with backward_scale(i), ended before the window's last engine.step()."""
    lw.begin(num_samples=mine)
    for microbatch, rows in enumerate(mine):
        loss = loss_of(engine, step, rank, microbatch, rows)
        engine.backward(loss * lw.backward_scale(microbatch))
        lw.record_loss(microbatch, loss)
        if microbatch == len(mine) - 1:
            lw.end()
        engine.step()


def unscaled_by_gas(engine: Any, lw: Any, step: int, rank: int, mine: list[int]) -> None:
    lw.begin(num_samples=mine)
    for microbatch, rows in enumerate(mine):
        loss = lw.scale_loss(loss_of(engine, step, rank, microbatch, rows))
        engine.backward(loss, scale_wrt_gas=False)
        if engine.is_gradient_accumulation_boundary():
            lw.end()
        engine.step()


def caller_owned(engine: Any, lw: Any, step: int, rank: int, mine: list[int]) -> None:
    """The loop of managed_gradient_accumulation false: one engine.step() a window."""
    lw.begin(num_samples=mine)
    for microbatch, rows in enumerate(mine):
        engine.backward(lw.scale_loss(loss_of(engine, step, rank, microbatch, rows)))
    lw.end()
    engine.step()


STRAYS: dict[str, tuple[Any, int, list, dict[str, Any]]] = {
    # name: (loop, or one per window; ZeRO stage; windows; engine config)
    "end-after-step/short": (end_after_step, 2, SHORT_THEN_FULL, {}),
    "end-after-step/scale-after": (scale_after_end_after_step, 0, SHORT_THEN_FULL, {}),
    "end-after-step/scale-after-full": (scale_after_end_after_step, 0, WINDOWS[:1], {}),
    "end-after-step/scale-after-long": (scale_after_end_after_step, 0, LONG_THEN_FULL, {}),
    "step-at-end/scale-after-long": (scale_after_step_at_end, 0, LONG_THEN_FULL, {}),
    "by-hand/long": (by_hand, 0, LONG_THEN_FULL, {}),
    # A short count-first window leaves DeepSpeed's count 2 microbatches into its next.
    "by-hand/after-short": ([documented, by_hand, by_hand], 2, [*SHORT_THEN_FULL, WINDOWS[1]], {}),
    "scale-wrt-gas-false": (unscaled_by_gas, 2, WINDOWS[:2], {}),
    "unmanaged/documented": (documented, 2, WINDOWS[:2], {"managed_gradient_accumulation": False}),
    "unmanaged/caller-owned": (
        caller_owned,
        2,
        WINDOWS[:2],
        {"managed_gradient_accumulation": False},
    ),
    "documented/long": (documented, 2, LONG_THEN_FULL, {}),
}


def stray_run(rank: int, world_size: int, names: list[str]) -> dict[str, Any]:
    """Each loop of ``names`` over its windows with a learning rate: each window's update
    against its full-batch gradient at the weights it started from, until a call raises."""
    from lossweight.integrations.deepspeed import DeepSpeedAccumulator

    start_deepspeed(rank, world_size)
    base = model()
    outcome: dict[str, Any] = {}
    for name in names:
        loop, stage, windows, extra = STRAYS[name]
        loops = loop if isinstance(loop, list) else [loop] * len(windows)
        seen: dict[str, Any] = {"errors": [], "error": None, "unchanged": None}
        outcome[name] = seen
        engine = engine_for(base, stage, lr=LR, **extra)
        before = [p.detach().double().clone() for p in engine.module.parameters()]
        try:
            lw = DeepSpeedAccumulator(engine, loss_reduction="sum", weight_by="samples")
            for step, ranks in enumerate(windows):
                expected = at_current_weights(engine, base, step, ranks)
                before = [p.detach().double().clone() for p in engine.module.parameters()]
                loops[step](engine, lw, step, rank, ranks[rank])
                after = [p.detach().double() for p in engine.module.parameters()]
                grads = [(b - a) / LR for b, a in zip(before, after, strict=True)]
                seen["errors"].append(relative_error(grads, expected))
        except Exception as error:  # what the loop raised, on this rank: the message counts
            seen["error"] = f"{type(error).__name__}: {error}"
            now = [p.detach().double() for p in engine.module.parameters()]
            seen["unchanged"] = all(map(torch.equal, before, now))
    return outcome


def start_deepspeed(rank: int, world_size: int) -> None:
    distributed_environment(rank, world_size)
    warnings.filterwarnings("ignore")
    without_shared_memory_op()
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")


UNEVEN = [[[1, 2, 1], [2, 3]]]  # rank 1 has a microbatch fewer


def uneven_run(rank: int, world_size: int, stage: int) -> dict[str, Any]:
    """The documented loop over a step whose ranks have 3 and 2 microbatches: what it raises
    on this rank, and whether the parameters moved."""
    from lossweight.integrations.deepspeed import DeepSpeedAccumulator

    start_deepspeed(rank, world_size)
    base = model()
    engine = engine_for(base, stage, lr=LR)
    lw = DeepSpeedAccumulator(engine, loss_reduction="sum", weight_by="samples")
    before = [p.detach().clone() for p in engine.module.parameters()]
    try:
        documented(engine, lw, 0, rank, UNEVEN[0][rank])
        error = None
    except Exception as raised:
        error = f"{type(raised).__name__}: {raised}"
    unchanged = all(map(torch.equal, before, engine.module.parameters()))
    return {"error": error, "unchanged": unchanged}
