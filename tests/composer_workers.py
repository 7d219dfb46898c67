"""What each process of tests/test_composer.py runs: MosaicML Composer on real gloo ranks.

``composer_run(rank, world_size, configs)`` trains tests/problem.py's fp64 model with Composer's
``Trainer`` on this rank's share of tests/integration_workers.py's loop data (rank 1 holds few
tokens and rows without any target), once per configuration, and returns, for every batch
(optimizer step), the gradient's relative error against the single-process fp64 full-batch
gradient, the loss Composer logged and the full-batch loss.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .integration_workers import (
    LOOP_STEPS,
    distributed_environment,
    gradients,
    loop_step,
    reference_gradients,
)
from .problem import CLASSES, IGNORE, Batch, max_relative_error, microbatch_loss

# Each configuration: lossweight's callback ("lossweight", loss_reduction) or Composer's own
# token mode ("composer", how its counter counts: "padded" or "targets", and whether loss()
# returns a dict), and device_train_microbatch_size.
CONFIGS: dict[str, dict[str, Any]] = {
    **{
        f"lossweight-sum/{size}": {"weighting": "lossweight", "reduction": "sum", "size": size}
        for size in (1, 2, 3, 8)
    },
    **{
        f"lossweight-mean/{size}": {"weighting": "lossweight", "reduction": "mean", "size": size}
        for size in (1, 3)
    },
    **{
        f"composer-{counter}-{form}/{size}": {
            "weighting": "composer",
            "counter": counter,
            "form": form,
            "size": size,
        }
        for counter in ("padded", "targets")
        for form in ("tensor", "dict")
        for size in (1, 3)
    },
    "lossweight-sum/retried": {"weighting": "lossweight", "reduction": "sum", "size": 8},
}


def batches(world_size: int) -> list[dict[str, torch.Tensor]]:
    """Every rank's batch of every step, in the order a DistributedSampler without shuffling
    deals them out (item i to rank i % world_size); ``input_ids`` is what Composer's default
    token counter reads (its shape: every position, padding included)."""
    out = []
    for step in range(LOOP_STEPS):
        for rank in range(world_size):
            mine = loop_step(step, rank)[1]
            features = torch.cat([mb.features for mb in mine])
            labels = torch.cat([mb.labels for mb in mine])
            out.append({"features": features, "labels": labels, "input_ids": labels.clone()})
    return out


def composer_run(rank: int, world_size: int, names: list[str]) -> dict:
    distributed_environment(rank, world_size)
    from composer import Algorithm, Callback, Event, Trainer
    from composer.core import DataSpec
    from composer.models import ComposerModel

    from lossweight.integrations.composer import LossweightCallback

    from .problem import make_model

    class Model(ComposerModel):
        def __init__(self, config: dict, lw: LossweightCallback | None) -> None:
            super().__init__()
            self.net, self.config, self.lw = make_model(7), config, lw
            self.oom_once = config is CONFIGS["lossweight-sum/retried"]

        def forward(self, batch: dict) -> torch.Tensor:
            # Composer pairs its collectives of automatic microbatching by microbatch, so the
            # ranks must have as many microbatches: 2 each, of 4 rows or fewer.
            if self.oom_once and batch["labels"].shape[0] > 4:
                # As a GPU that runs out of memory on a large microbatch: Composer's automatic
                # microbatching halves the microbatch size and runs the batch again.
                raise RuntimeError("CUDA out of memory (raised by the test)")
            return self.net(batch["features"])

        def loss(self, outputs: torch.Tensor, batch: dict) -> Any:
            mb = Batch(batch["features"], batch["labels"])
            if self.lw is not None:
                reduction = self.config["reduction"]
                loss = microbatch_loss(self.net, mb, "tokens", reduction)
                return self.lw.scale_loss(loss, num_tokens=mb.num_tokens)
            # Composer's own weighting: the mean over the microbatch's targets, as
            # F.cross_entropy gives it (NaN for a microbatch without any).
            mean = F.cross_entropy(
                outputs.reshape(-1, CLASSES), batch["labels"].reshape(-1), ignore_index=IGNORE
            )
            return {"total": mean} if self.config["form"] == "dict" else mean

    class Recorder(Callback):
        """The gradient just before optimizer.step(), against the full batch's."""

        def __init__(self, model: Model) -> None:
            self.model, self.steps = model, []

        def after_train_batch(self, state: Any, logger: Any) -> None:
            batch, _ = loop_step(len(self.steps), rank)
            expected_loss, expected = reference_gradients(
                self.model.net, lambda m: microbatch_loss(m, batch, "tokens", "mean")
            )
            self.steps.append(
                {
                    "relative_error": max_relative_error(gradients(self.model.net), expected),
                    "expected_loss": expected_loss,
                }
            )

        def batch_end(self, state: Any, logger: Any) -> None:
            self.steps[-1]["loss"] = state.total_loss_dict["loss/train/total"]

    class AutoMicrobatching(Algorithm):
        """Turns on Composer's retry of a batch that ran out of memory, which Composer itself
        allows on a GPU only."""

        def match(self, event: Any, state: Any) -> bool:
            return event == Event.FIT_START

        def apply(self, event: Any, state: Any, logger: Any) -> None:
            state.auto_microbatching = True

    outcome = {}
    data = batches(world_size)
    for name in names:
        config = CONFIGS[name]
        lw = None
        if config["weighting"] == "lossweight":
            lw = LossweightCallback(loss_reduction=config["reduction"])
        model = Model(config, lw)
        recorder = Recorder(model)
        sampler = torch.utils.data.DistributedSampler(data, shuffle=False)
        loader = torch.utils.data.DataLoader(data, batch_size=None, sampler=sampler)
        spec: Any = loader
        if config.get("counter") == "targets":
            spec = DataSpec(
                loader,
                get_num_tokens_in_batch=lambda b: {
                    "total": b["labels"].numel(),
                    "loss_generating": int((b["labels"] != IGNORE).sum()),
                },
            )
        trainer = Trainer(
            model=model,
            train_dataloader=spec,
            max_duration=f"{LOOP_STEPS}ba",
            optimizers=torch.optim.SGD(model.parameters(), lr=0.5),
            device="cpu",
            device_train_microbatch_size=config["size"],
            accumulate_train_batch_on_tokens=config["weighting"] == "composer",
            callbacks=[lw, recorder] if lw is not None else [recorder],
            algorithms=[AutoMicrobatching()] if name.endswith("retried") else [],
            loggers=[],
            progress_bar=False,
            log_to_console=False,
            save_folder=None,
            seed=7,
        )
        trainer.fit()
        outcome[name] = recorder.steps
        if lw is not None:
            outcome[name + ":steps_begun"] = lw.accumulator.steps
    return outcome


def composer_misuse_run(rank: int, world_size: int) -> dict:
    """A model whose loss() returns its loss without the callback's scale_loss(): the first
    backward goes through no weighted loss, and every rank raises there."""
    distributed_environment(rank, world_size)
    from composer import Trainer
    from composer.models import ComposerModel

    from lossweight.integrations.composer import LossweightCallback

    from .problem import make_model

    class Unweighted(ComposerModel):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_model(7)

        def forward(self, batch: dict) -> torch.Tensor:
            return self.net(batch["features"])

        def loss(self, outputs: torch.Tensor, batch: dict) -> Any:
            return microbatch_loss(
                self.net, Batch(batch["features"], batch["labels"]), "tokens", "sum"
            )

    data = batches(world_size)
    sampler = torch.utils.data.DistributedSampler(data, shuffle=False)
    model = Unweighted()
    trainer = Trainer(
        model=model,
        train_dataloader=torch.utils.data.DataLoader(data, batch_size=None, sampler=sampler),
        max_duration="1ba",
        optimizers=torch.optim.SGD(model.parameters(), lr=0.5),
        device="cpu",
        device_train_microbatch_size=2,
        callbacks=[LossweightCallback(loss_reduction="sum")],
        loggers=[],
        progress_bar=False,
        log_to_console=False,
    )
    try:
        trainer.fit()
    except RuntimeError as raised:
        return {"error": str(raised)}
    return {"error": None}
