"""The accelerate and Lightning integrations, used wrongly: each slip that would train on a
wrong gradient or log a wrong loss is made exact, or refused with an error that names the fix
before any parameter moves (but for an optimizer accelerate did not prepare, which makes one
update first); and clipping clips the exact gradient.

Lightning runs in this process (one device); accelerate in one fresh process, since an
Accelerator's state is process-wide. The data are tests/integration_workers.py's: uneven
padding and a microbatch without any target, both ranks' microbatches of a step in one window.
"""

from __future__ import annotations

import copy
import socket
from typing import Any

import pytest
import torch

from . import integration_workers as workers
from .gloo import run_ranks, values

EXACT = 1e-10  # fp64 end to end


def check_exact_and_clipped(steps: list[dict], clip: float | None) -> None:
    assert len(steps) == workers.MISUSE_STEPS
    for step in steps:
        assert step["relative_error"] < EXACT, steps
        assert step["tokens"] == step["expected_tokens"]
        if clip is not None:  # the clipping did clip: the test tells its order
            assert step["exact_norm"] > 2 * clip


# ------------------------------------------------------------------------------------------
# Lightning
# ------------------------------------------------------------------------------------------


def test_lightning_validation_inside_a_window_leaves_the_training_step_alone() -> None:
    # validation_step calls the helper that calls scale_loss(), and runs after every 3rd
    # batch, inside the windows of 8: its microbatches must join no training step.
    seen = workers.lightning_misuse_run("validated")
    assert seen["error"] is None
    check_exact_and_clipped(seen["steps"], None)
    # Outside training, scale_loss() returns the loss it was given.
    assert len(seen["validation_returned"]) >= 4 and all(seen["validation_returned"])


@pytest.mark.parametrize(
    ("case", "message"),
    [
        # training_step scales the loss but returns the raw one.
        ("raw", "a backward() during training went through no loss that"),
        # training_step never calls scale_loss().
        ("unscaled", "return the callback's scale_loss(loss, num_tokens=...) from training_step"),
        # training_step scales each loss a second time, e.g. to log it.
        ("twice", "only 8 of the 16 losses that LossweightCallback.scale_loss() returned"),
    ],
    ids=["raw", "unscaled", "twice"],
)
def test_lightning_refuses_a_backward_that_scale_loss_did_not_weight(
    case: str, message: str
) -> None:
    seen = workers.lightning_misuse_run(case)
    assert seen["error"] is not None and message in seen["error"], seen["error"]
    if case == "twice":
        assert "a loss scaled and not back-propagated counts in the step's weights" in seen["error"]
    assert seen["steps"] == [] and seen["unchanged"]  # refused before the first update


def test_lightning_clips_the_exact_gradient() -> None:
    # Lightning clips after on_before_optimizer_step, where the callback ends the step.
    seen = workers.lightning_misuse_run("documented", clip=workers.CLIP)
    assert seen["error"] is None
    check_exact_and_clipped(seen["steps"], workers.CLIP)


# ------------------------------------------------------------------------------------------
# accelerate, scaling after
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def accelerate() -> dict:
    (outcome,) = values(run_ranks(1, workers.accelerate_misuse_run, init_group=False, deadline=90))
    return outcome


def test_accelerate_clips_the_exact_gradient(accelerate: dict) -> None:
    # end_if_sync(), then accelerator.clip_grad_norm_(), as documented.
    seen = accelerate["documented"]
    assert seen["error"] is None
    check_exact_and_clipped(seen["steps"], workers.CLIP)


def test_accelerate_refuses_an_optimizer_step_without_end_if_sync(accelerate: dict) -> None:
    seen = accelerate["no_end"]
    assert seen["error"] is not None, seen
    assert "end_if_sync() was not called to rescale them" in seen["error"]
    # The prepared optimizer's step at the window's last microbatch refused to update.
    assert seen["blocks"] == workers.MISUSE_WINDOW and seen["unchanged"]


def test_accelerate_refuses_the_next_microbatch_after_a_missed_end(accelerate: dict) -> None:
    # An optimizer accelerate did not prepare is not watched: its one update is made, and the
    # next accumulate() block refuses to begin.
    seen = accelerate["no_end_unprepared"]
    assert seen["error"] is not None, seen
    assert "end_if_sync() was not called to rescale them" in seen["error"]
    assert seen["blocks"] == workers.MISUSE_WINDOW and not seen["unchanged"]


def test_accelerate_refuses_end_if_sync_before_the_last_backward(accelerate: dict) -> None:
    seen = accelerate["end_before_backward"]
    assert seen["error"] is not None, seen
    assert "only 7 of the 8 losses that scale_loss() returned" in seen["error"]
    assert seen["blocks"] == workers.MISUSE_WINDOW and seen["unchanged"]


# ------------------------------------------------------------------------------------------
# Hugging Face Trainer: a model whose loss cannot be read
# ------------------------------------------------------------------------------------------


class OwnLossModel(torch.nn.Module):
    """Not a transformers model: its forward computes a loss lossweight cannot read."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(8, 8)

    def forward(self, input_ids: Any, labels: Any = None, shift_labels: Any = None) -> dict:
        logits = self.embed(input_ids)
        targets = labels if shift_labels is None else shift_labels
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return {"loss": loss, "logits": logits}


def own_loss_train(tmp: str, rows: list[dict]) -> None:
    from transformers import TrainingArguments

    from lossweight.integrations.hf import LossweightTrainer

    args = TrainingArguments(
        output_dir=tmp, per_device_train_batch_size=2, max_steps=1, use_cpu=True,
        report_to=[], save_strategy="no", disable_tqdm=True, remove_unused_columns=False,
    )  # fmt: skip

    def collate(batch: list[dict]) -> dict:
        return {name: torch.stack([row[name] for row in batch]) for name in batch[0]}

    trainer = LossweightTrainer(
        model=OwnLossModel(), args=args, train_dataset=rows, data_collator=collate
    )
    trainer.train()


def test_hf_token_labels_of_a_loss_it_cannot_read_are_refused(tmp_path: Any) -> None:
    pytest.importorskip("transformers")
    ids = torch.tensor([1, 2, 3, 4])
    rows = [{"input_ids": ids, "labels": ids} for _ in range(2)]
    with pytest.raises(ValueError) as raised:
        own_loss_train(str(tmp_path), rows)
    assert "cannot tell whether the loss of OwnLossModel shifts them" in str(raised.value)
    assert "let the data collator return 'shift_labels'" in str(raised.value)
    # The fix: the targets each position's loss compares with, counted as given.
    own_loss_train(str(tmp_path), [{**row, "shift_labels": row["labels"]} for row in rows])


def test_hf_the_shift_is_read_from_the_loss_function() -> None:
    pytest.importorskip("transformers")
    from transformers.loss.loss_utils import (
        ForCausalLMLoss,
        ForMaskedLMLoss,
        ForTokenClassification,
    )

    from lossweight.integrations.hf import _shifts

    assert _shifts(ForCausalLMLoss) is True
    assert _shifts(ForMaskedLMLoss) is False
    assert _shifts(ForTokenClassification) is False
    assert _shifts(lambda labels, logits, config: labels.sum()) is None  # a classifier's


def test_accelerate_refuses_a_world_a_model_or_a_window_it_was_not_built_for() -> None:
    # Two gloo ranks, where the Accelerator (cpu=True, no launcher) sees one process.
    refused = values(run_ranks(2, workers.accelerate_refusals_run, deadline=90))
    for seen in refused:
        assert seen["other_world"] == (
            "RuntimeError: the default process group has 2 ranks but the Accelerator 1 "
            "processes; lossweight reduces over the default group, which must be the "
            "Accelerator's data-parallel world"
        )
        assert seen["no_model"].startswith(
            "ValueError: AcceleratorAccumulator needs the prepared model, to skip its gradient "
            "synchronization and to rescale its gradients: pass it to the constructor"
        )
        assert seen["steps_changed"] == (
            f"RuntimeError: accelerator.gradient_accumulation_steps changed from "
            f"{workers.MISUSE_WINDOW} to {workers.MISUSE_WINDOW + 1}; build a new "
            "AcceleratorAccumulator after changing it"
        )


def test_accelerate_under_deepspeed_refuses_to_scale_after() -> None:
    with socket.socket() as probe:  # a free port for DeepSpeed's own process group
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    (message,) = values(
        run_ranks(1, workers.accelerate_under_deepspeed_run, port, init_group=False, deadline=120)
    )
    assert message.startswith(
        "under DeepSpeed, accelerator.backward() steps the optimizer at the step's last "
        "microbatch, before end() could rescale the gradients; count first"
    )


# ------------------------------------------------------------------------------------------
# Hugging Face Trainer: a compute_loss override, and label smoothing
# ------------------------------------------------------------------------------------------

ROWS = [torch.arange(1, n + 1) for n in (9, 7, 1, 1, 12, 3)]  # microbatch 2: one label a row


def _collate(batch: list[torch.Tensor]) -> dict:
    ids = torch.zeros(len(batch), max(len(row) for row in batch), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for index, row in enumerate(batch):
        ids[index, : len(row)], mask[index, : len(row)] = row, 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _llama(subclass: bool) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    class RenamedLlama(LlamaForCausalLM):  # a class name transformers does not list
        pass

    config = LlamaConfig(
        vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    return (RenamedLlama if subclass else LlamaForCausalLM)(config).double()


def _one_step(tmp: str, model: torch.nn.Module, trainer_class: type, smoothing: float) -> Any:
    """The lm_head gradient of one optimizer step of 3 microbatches of 2 rows."""
    from transformers import TrainerCallback, TrainingArguments

    grads = []

    class Grab(TrainerCallback):  # type: ignore[misc]
        def on_pre_optimizer_step(self, *args: Any, **kwargs: Any) -> None:
            grads.append(model.lm_head.weight.grad.clone())

    args = TrainingArguments(
        output_dir=tmp, per_device_train_batch_size=2, gradient_accumulation_steps=3,
        max_steps=1, learning_rate=0.0, max_grad_norm=0.0, label_smoothing_factor=smoothing,
        use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    trainer = trainer_class(
        model=model, args=args, train_dataset=ROWS, data_collator=_collate, callbacks=[Grab()]
    )
    trainer.train()
    return grads[0]


def test_hf_a_compute_loss_override_that_skips_scale_loss_is_refused(tmp_path: Any) -> None:
    # Before: no error; the gradient the sum of the microbatches' means, 2.1 times the exact.
    pytest.importorskip("transformers")
    from lossweight.integrations.hf import LossweightTrainer

    class OwnLoss(LossweightTrainer):  # type: ignore[misc]
        def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, **_: Any):  # type: ignore[no-untyped-def]
            outputs = model(**inputs)
            return (outputs.loss, outputs) if return_outputs else outputs.loss

    with pytest.raises(RuntimeError) as raised:
        _one_step(str(tmp_path), _llama(subclass=False), OwnLoss, 0.0)
    assert "OwnLoss.training_step() back-propagated a loss of step 1 that did not go" in str(
        raised.value
    )
    assert "call super().compute_loss(model, inputs, ...)" in str(raised.value)


@pytest.mark.parametrize("subclass", [False, True])
def test_hf_label_smoothing_counts_the_labels_its_smoother_covers(
    tmp_path: Any, subclass: bool
) -> None:
    # Trainer's label smoother shifts the labels of a listed causal LM alone: a subclass named
    # otherwise gets unshifted ones. Before: counted shifted anyway, 0.65% off.
    pytest.importorskip("transformers")
    from lossweight.integrations.hf import LossweightTrainer

    smoothing, model = 0.1, _llama(subclass)
    reference = copy.deepcopy(model)
    batch = _collate(ROWS)
    logits = reference(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels = batch["labels"]
    if not subclass:
        logits, labels = logits[:, :-1], labels[:, 1:]
    logits, labels = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
    log_p = torch.log_softmax(logits[labels != -100], -1)
    nll = -log_p.gather(1, labels[labels != -100, None]).squeeze(1)
    ((1 - smoothing) * nll + smoothing * -log_p.mean(-1)).mean().backward()
    got = _one_step(str(tmp_path), model, LossweightTrainer, smoothing)
    error = (got - reference.lm_head.weight.grad).abs().max() / got.abs().max()
    assert error < 1e-6, error  # the model's norms compute in float32
