"""What each process of tests/test_integrations.py runs: real frameworks on real gloo ranks.

Each ``*_run(rank, world_size)`` function is started by tests/gloo.py on 2 processes joined in
one gloo process group, runs every configuration of its framework on this rank's share of the
data (uneven padding, a rank with few tokens, a microbatch without a target), compares the
gradient just before each optimizer step with the single-process fp64 full-batch reference,
and returns what it saw as JSON-able values: relative gradient errors, logged losses and
counts, and the references they should equal. The misuse section runs on one process, for
tests/test_integration_misuse.py.
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import os
import warnings
from typing import Any

import torch
import torch.nn.functional as F

from .problem import (
    IGNORE,
    Batch,
    make_batch,
    make_model,
    max_relative_error,
    microbatch_loss,
    split,
)


def distributed_environment(rank: int, world_size: int) -> None:
    """The variables that frameworks read to find the process group tests/gloo.py started."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        NODE_RANK="0",
        GROUP_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="1",  # nothing listens there: a framework must use the existing group
        OMP_NUM_THREADS="1",  # else accelerate sets the threads from the CPU count
        TOKENIZERS_PARALLELISM="false",
    )
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)


def gradients(model: torch.nn.Module) -> list[torch.Tensor]:
    return [
        p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        for p in model.parameters()
    ]


def reference_gradients(model: torch.nn.Module, loss_of: Any) -> tuple[float, list[torch.Tensor]]:
    """The full-batch loss and gradient of ``loss_of(copy of model)``, on a copy."""
    model = copy.deepcopy(model)
    loss = loss_of(model)
    loss.backward()
    return loss.item(), gradients(model)


# --------------------------------------------------------------------------------------------
# Hugging Face transformers.Trainer
# --------------------------------------------------------------------------------------------

HF_STEPS = 2
HF_MICROBATCHES = 2  # gradient_accumulation_steps
HF_ROWS = 2  # per_device_train_batch_size
# The real tokens of each row, by step, rank and microbatch. Rank 1 holds few tokens, and in
# step 1 a microbatch of two one-token rows, which after the causal shift has no target at all
# (unshifted, it would count 2).
HF_LENGTHS = [
    [[[7, 5], [6, 8]], [[3, 2], [1, 1]]],
    [[[2, 8], [4, 4]], [[8, 3], [5, 2]]],
]
# Classifier rows that the collator drops (as a filter would): uneven microbatches of samples.
HF_DROPPED = {(0, 1, 0, 1), (1, 0, 1, 0), (1, 1, 1, 1)}  # (step, rank, microbatch, row)


def hf_rows(world_size: int) -> list[dict]:
    """The training rows in the order that Trainer's sequential sampler, sharded by
    accelerate (batch i goes to rank i % world_size), deals them out as HF_LENGTHS says."""
    generator = torch.Generator().manual_seed(0)
    rows = []
    for step in range(HF_STEPS):
        for microbatch in range(HF_MICROBATCHES):
            for rank in range(world_size):
                for row, length in enumerate(HF_LENGTHS[step][rank][microbatch]):
                    ids = torch.randint(1, 32, (length,), generator=generator)
                    labels = ids.clone()
                    if step == 1 and rank == 0 and row == 0:
                        labels[:3] = IGNORE  # a prompt without targets
                    rows.append(
                        {
                            "input_ids": ids,
                            "labels": labels,
                            "class": int(torch.randint(0, 3, (), generator=generator)),
                            "keep": (step, rank, microbatch, row) not in HF_DROPPED,
                            "where": (step, rank, microbatch),
                        }
                    )
    return rows


class HFCollator:
    """Pads each microbatch to its own longest row; records what each rank got."""

    def __init__(self, classify: bool) -> None:
        self.classify = classify
        self.seen: list[tuple[list[int], int]] = []

    def __call__(self, items: list[dict]) -> dict[str, torch.Tensor]:
        if self.classify:
            items = [item for item in items if item["keep"]]
        length = max(len(item["input_ids"]) for item in items)
        ids = torch.zeros(len(items), length, dtype=torch.long)
        mask = torch.zeros_like(ids)
        labels = torch.full_like(ids, IGNORE)
        for i, item in enumerate(items):
            n = len(item["input_ids"])
            ids[i, :n], mask[i, :n], labels[i, :n] = item["input_ids"], 1, item["labels"]
        self.seen.append((list(items[0]["where"]), len(items)))
        if self.classify:
            classes = torch.tensor([item["class"] for item in items])
            return {"input_ids": ids, "attention_mask": mask, "labels": classes}
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def fp64_causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab_size: int,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """transformers' ForCausalLMLoss without its upcast to float32, which would make an fp64
    model's loss fp32 (the genuine one is tested too, at fp32's tolerance)."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = F.cross_entropy(
        logits.reshape(-1, vocab_size),
        shift_labels.reshape(-1).to(logits.device),
        ignore_index=ignore_index,
        reduction=reduction,
    )
    return loss / num_items_in_batch if num_items_in_batch is not None else loss


def fp64_throughout(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with Llama's RMSNorm and rotary embedding computing in the model's float64.

    transformers computes both in float32 whatever the model's dtype. Their float32 rounding
    depends on the tensor's shape and on the CPU's vector width: with AVX2 kernels a
    microbatch's rows round unlike the same rows in the full batch (5e-8 apart), with AVX-512
    they happen to agree. An fp64 reference is only exact for a model that is fp64 throughout.
    """
    from transformers.models.llama import modeling_llama as llama

    class RMSNorm(llama.LlamaRMSNorm):
        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            variance = hidden_states.pow(2).mean(-1, keepdim=True)
            return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))

    class RotaryEmbedding(llama.LlamaRotaryEmbedding):
        def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> Any:
            freqs = position_ids[..., None].to(x.dtype) * self.inv_freq.to(x.dtype)
            angles = torch.cat((freqs, freqs), dim=-1)
            return angles.cos() * self.attention_scaling, angles.sin() * self.attention_scaling

    for module in model.modules():
        if type(module) is llama.LlamaRMSNorm:
            module.__class__ = RMSNorm
        elif type(module) is llama.LlamaRotaryEmbedding:
            module.__class__ = RotaryEmbedding
    return model


class Float32Results(torch.overrides.TorchFunctionMode):
    """Records the torch functions that return a float32 tensor while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        result = func(*args, **(kwargs or {}))
        if isinstance(result, torch.Tensor) and result.dtype == torch.float32:
            self.names.add(getattr(func, "__name__", str(func)))
        return result


def hf_models() -> dict[str, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    class NoLossKwargsLlamaForCausalLM(LlamaForCausalLM):
        """A causal LM whose forward takes no loss kwargs: Trainer passes it no
        num_items_in_batch and falls back to the mean divided by the accumulation steps."""

        def forward(self, input_ids, attention_mask=None, labels=None):  # type: ignore[override]
            return super().forward(
                input_ids=input_ids, attention_mask=attention_mask, labels=labels
            )

    class NoLossKwargsLlamaForSequenceClassification(LlamaForSequenceClassification):
        def forward(self, input_ids, attention_mask=None, labels=None):  # type: ignore[override]
            return super().forward(
                input_ids=input_ids, attention_mask=attention_mask, labels=labels
            )

    class TinyLM(LlamaForCausalLM):
        """A causal LM under a name that says nothing of its loss (its loss_type is None, and
        its loss_function transformers' default, ForCausalLMLoss)."""

    class Wrapped(torch.nn.Module):
        """A module around a causal LM, whose forward is the LM's."""

        def __init__(self, lm: torch.nn.Module) -> None:
            super().__init__()
            self.lm = lm

        def forward(self, input_ids, attention_mask=None, labels=None):  # type: ignore[no-untyped-def]
            return self.lm(input_ids=input_ids, attention_mask=attention_mask, labels=labels)

    config = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=16,
        pad_token_id=0,
        num_labels=3,
        attn_implementation="sdpa",  # eager attention takes its softmax in float32
    )

    def build(cls: type, fp64_loss: bool) -> torch.nn.Module:
        torch.manual_seed(0)
        model = fp64_throughout(cls(config).double())
        if fp64_loss:
            model.loss_function = fp64_causal_lm_loss
        return model

    return {
        "llama": build(LlamaForCausalLM, True),
        "llama-fp32-loss": build(LlamaForCausalLM, False),
        "no-loss-kwargs": build(NoLossKwargsLlamaForCausalLM, True),
        "classifier": build(NoLossKwargsLlamaForSequenceClassification, False),
        "subclass": build(TinyLM, True),
        "wrapper": Wrapped(build(LlamaForCausalLM, True)),
    }


# (model, trainer, weight_by, average_tokens_across_devices)
HF_CONFIGS = {
    "llama/plain": ("llama", "plain", "tokens", True),
    "llama/plain-no-average": ("llama", "plain", "tokens", False),
    "llama/lossweight": ("llama", "lossweight", "tokens", True),
    "llama/lossweight-no-average": ("llama", "lossweight", "tokens", False),
    "no-loss-kwargs/plain": ("no-loss-kwargs", "plain", "tokens", True),
    "no-loss-kwargs/lossweight": ("no-loss-kwargs", "lossweight", "tokens", True),
    "classifier/plain": ("classifier", "plain", "samples", True),
    "classifier/lossweight": ("classifier", "lossweight", "samples", True),
    "llama-fp32-loss/lossweight": ("llama-fp32-loss", "lossweight", "tokens", True),
    "llama/lossweight-clipped": ("llama", "lossweight", "tokens", True),
    "subclass/lossweight": ("subclass", "lossweight", "tokens", True),
    "wrapper/lossweight": ("wrapper", "lossweight", "tokens", True),
}
# Clipped by the Trainer (max_grad_norm) to half the smallest norm of the steps' full-batch
# gradients, so that every step clips; the others do not clip.
HF_CLIPPED = {"llama/lossweight-clipped"}


def hf_reference(model: torch.nn.Module, rows: list[dict], classify: bool) -> list[dict]:
    """Per step: the full-batch loss, gradient and counts over every rank's rows."""
    per_step = len(rows) // HF_STEPS
    references = []
    for step in range(HF_STEPS):
        batch = HFCollator(classify)(rows[step * per_step : (step + 1) * per_step])
        loss, grads = reference_gradients(model, lambda m, b=batch: m(**b).loss)
        targets = batch["labels"] if classify else batch["labels"][:, 1:]
        references.append(
            {
                "loss": loss,
                "grads": grads,
                "tokens": int((targets != IGNORE).sum()),
                "samples": int(batch["input_ids"].shape[0]),
            }
        )
    return references


def hf_run(rank: int, world_size: int, tmp: str) -> dict:
    distributed_environment(rank, world_size)
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from lossweight.integrations.hf import LossweightTrainer

    rows = hf_rows(world_size)
    models = hf_models()

    class Dataset(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(rows)

        def __getitem__(self, index: int) -> dict:
            return rows[index]

    class Gradients(TrainerCallback):
        """The gradient just before each optimizer step, after the Trainer clipped it."""

        def __init__(self) -> None:
            self.steps: list[list[torch.Tensor]] = []

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            self.steps.append(gradients(model))

    outcome: dict[str, Any] = {"float32_functions": {}}
    for model_name, model in models.items():  # what of each model computes in float32
        batch = HFCollator(model_name == "classifier")(rows[: len(rows) // HF_STEPS])
        with Float32Results() as seen:
            copy.deepcopy(model)(**batch).loss.backward()
        outcome["float32_functions"][model_name] = sorted(seen.names)
    evaluations = {}
    for name, (model_name, kind, weight_by, average) in HF_CONFIGS.items():
        classify = model_name == "classifier"
        base = models[model_name]
        references = hf_reference(base, rows, classify)
        clip = 0.0  # no clipping: the gradient as the step made it
        if name in HF_CLIPPED:
            norms = [torch.stack([g.norm() for g in r["grads"]]).norm() for r in references]
            clip = float(min(norms)) / 2
            for reference, norm in zip(references, norms, strict=True):
                reference["grads"] = [g * (clip / (norm + 1e-6)) for g in reference["grads"]]
        args = TrainingArguments(
            output_dir=f"{tmp}/hf-{rank}",
            per_device_train_batch_size=HF_ROWS,
            per_device_eval_batch_size=HF_ROWS,
            gradient_accumulation_steps=HF_MICROBATCHES,
            max_steps=HF_STEPS,
            learning_rate=0.0,  # the same parameters in every step: one reference each
            max_grad_norm=clip,
            average_tokens_across_devices=average,
            train_sampling_strategy="sequential",
            remove_unused_columns=False,  # the collator reads the rows' bookkeeping
            use_cpu=True,
            ddp_find_unused_parameters=False,
            report_to=[],
            logging_steps=1,
            save_strategy="no",
            disable_tqdm=True,
        )
        collator, grab = HFCollator(classify), Gradients()
        options = {"weight_by": weight_by} if kind == "lossweight" else {}
        cls = LossweightTrainer if kind == "lossweight" else Trainer
        trainer = cls(
            model=copy.deepcopy(base),
            args=args,
            train_dataset=Dataset(),
            eval_dataset=Dataset() if model_name == "llama" else None,
            data_collator=collator,
            callbacks=[grab],
            **options,
        )
        with contextlib.redirect_stdout(io.StringIO()):  # Trainer prints its logs
            trainer.train()
            dealt = list(collator.seen)
            if model_name == "llama" and average:
                evaluations[kind] = trainer.evaluate()["eval_loss"]
        logs = [entry for entry in trainer.state.log_history if "loss" in entry]
        outcome[name] = {
            "relative_errors": [
                max_relative_error(seen, reference["grads"])
                for seen, reference in zip(grab.steps, references, strict=True)
            ],
            "logged_losses": [entry["loss"] for entry in logs],
            "logged_tokens": [entry.get("loss_tokens") for entry in logs],
            "logged_samples": [entry.get("loss_samples") for entry in logs],
            "train_loss": next(
                e["train_loss"] for e in trainer.state.log_history if "train_loss" in e
            ),
            "expected_losses": [reference["loss"] for reference in references],
            "expected_tokens": [reference["tokens"] for reference in references],
            "expected_samples": [reference["samples"] for reference in references],
            "microbatches": dealt,
        }
    outcome["eval_losses"] = evaluations
    return outcome


def hf_resume_run(rank: int, world_size: int, tmp: str) -> dict:
    """A run saved after one step of 2 microbatches and resumed with 4: each step's gradient and
    logged loss against the full batch of the rows the step was dealt."""
    distributed_environment(rank, world_size)
    from transformers import TrainerCallback, TrainingArguments

    from lossweight.integrations.hf import LossweightTrainer

    generator = torch.Generator().manual_seed(1)
    rows = []
    for index in range(12):
        ids = torch.randint(1, 32, (int(torch.randint(2, 9, (), generator=generator)),))
        rows.append({"input_ids": ids, "labels": ids.clone(), "where": [index, 0, 0]})
    base = hf_models()["llama"]
    index_of = {tuple(row["input_ids"].tolist()): i for i, row in enumerate(rows)}

    class Gradients(TrainerCallback):
        def __init__(self) -> None:
            self.steps: list[list[torch.Tensor]] = []

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            self.steps.append(gradients(model))

    class Recording(LossweightTrainer):
        """Records the rows of each step's batches (the data loader collates ahead)."""

        windows: list[list[int]]

        def get_batch_samples(self, *args: Any, **kwargs: Any) -> Any:
            batches, items = super().get_batch_samples(*args, **kwargs)
            rows_of = [tuple(int(t) for t in ids if t) for b in batches for ids in b["input_ids"]]
            self.windows.append([index_of[key] for key in rows_of])
            return batches, items

    outcome = {}
    for phase, accumulation, steps in (("saved", 2, 1), ("resumed", 4, 2)):
        args = TrainingArguments(
            output_dir=f"{tmp}/resume",
            per_device_train_batch_size=1,
            gradient_accumulation_steps=accumulation,
            max_steps=steps,
            learning_rate=0.0,  # every step's reference is the base model
            max_grad_norm=0.0,
            train_sampling_strategy="sequential",
            remove_unused_columns=False,
            use_cpu=True,
            report_to=[],
            logging_steps=1,
            save_strategy="steps",
            save_steps=1,
            disable_tqdm=True,
        )
        collator, grab = HFCollator(classify=False), Gradients()
        Recording.windows = []
        trainer = Recording(
            model=copy.deepcopy(base),
            args=args,
            train_dataset=rows,
            data_collator=collator,
            callbacks=[grab],
        )
        with contextlib.redirect_stdout(io.StringIO()):
            trainer.train(resume_from_checkpoint=phase == "resumed" or None)
        logs = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        windows = [window for window in Recording.windows if window]
        errors, expected = [], []
        for window, seen in zip(windows, grab.steps, strict=True):
            batch = HFCollator(classify=False)([rows[i] for i in window])
            loss, grads = reference_gradients(base, lambda m, b=batch: m(**b).loss)
            errors.append(max_relative_error(seen, grads))
            expected.append(loss)
        outcome[phase] = {
            "windows": windows,
            "relative_errors": errors,
            "logged_losses": logs[-len(windows) :],
            "expected_losses": expected,
            "steps": [entry["step"] for entry in trainer.state.log_history if "loss" in entry],
        }
    return outcome


# --------------------------------------------------------------------------------------------
# A hand-written data layout for accelerate and Lightning (tests/problem.py's fp64 model)
# --------------------------------------------------------------------------------------------

LOOP_MICROBATCHES = 4  # gradient_accumulation_steps / accumulate_grad_batches
# Microbatches per rank in each step: the last step is short, as at the end of an epoch whose
# length the accumulation steps do not divide (the frameworks still divide its losses by 4).
LOOP_WINDOWS = [4, 4, 2]
LOOP_STEPS = len(LOOP_WINDOWS)
# Rows per microbatch of each rank. Rank 1's rows hold one or two tokens, and its third
# microbatch none at all (every label is padding).
LOOP_SIZES = [[3, 1, 2, 2], [1, 2, 2, 1]]
LOOP_EMPTY = (1, 2)  # (rank, microbatch)


def loop_step(step: int, rank: int) -> tuple[Batch, list[Batch]]:
    """The global batch of a step, and this rank's microbatches of it."""
    layout = [sizes[: LOOP_WINDOWS[step]] for sizes in LOOP_SIZES]
    generator = torch.Generator().manual_seed(100 + step)
    lengths = [
        int(torch.randint(1, 9, (), generator=generator)) if r == 0 else 1 + row % 2
        for r, sizes in enumerate(layout)
        for row in range(sum(sizes))
    ]
    batch = make_batch(lengths, max_length=8, seed=100 + step, left_padding=step % 2 == 1)
    bounds = split(batch.num_samples, [sum(sizes) for sizes in layout])
    empty_rank, empty_microbatch = LOOP_EMPTY
    if empty_microbatch < LOOP_WINDOWS[step]:
        start, stop = bounds[empty_rank]
        empty = split(stop - start, layout[empty_rank])[empty_microbatch]
        batch.labels[start + empty[0] : start + empty[1]] = IGNORE
    start, stop = bounds[rank]
    mine = batch.rows(start, stop)
    return batch, [mine.rows(a, b) for a, b in split(stop - start, layout[rank])]


class StepRecorder:
    """Compares each step's gradient with the full-batch one at the same parameters."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.steps: list[dict] = []

    def record(self, model: torch.nn.Module, result: Any = None, loss: float | None = None) -> None:
        batch, _ = loop_step(len(self.steps), self.rank)
        expected_loss, expected = reference_gradients(
            model, lambda m: microbatch_loss(m, batch, "tokens", "mean")
        )
        seen = {
            "relative_error": max_relative_error(gradients(model), expected),
            "expected_loss": expected_loss,
            "expected_tokens": int(batch.num_tokens),
        }
        if result is not None:
            seen.update(loss=result.loss.item(), tokens=int(result.num_tokens))
        if loss is not None:  # what a loop without lossweight logs
            seen.update(loss=loss)
        self.steps.append(seen)


# --------------------------------------------------------------------------------------------
# accelerate
# --------------------------------------------------------------------------------------------


def loop_dataloader(world_size: int) -> torch.utils.data.DataLoader:
    """Every rank's microbatches of every step, one per batch, in the order that accelerate's
    sharding of a prepared dataloader (batch i to rank i % world_size) deals them out as
    loop_step() says; the short last step ends with the data."""
    items = []
    for step, microbatches in enumerate(LOOP_WINDOWS):
        shares = [loop_step(step, rank)[1] for rank in range(world_size)]
        for index in range(microbatches):
            for share in shares:
                items.append({"features": share[index].features, "labels": share[index].labels})
    return torch.utils.data.DataLoader(items, batch_size=1, collate_fn=lambda batch: batch[0])


def accelerate_run(rank: int, world_size: int) -> dict:
    distributed_environment(rank, world_size)
    from accelerate import Accelerator

    from lossweight.integrations.accelerate import AcceleratorAccumulator

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=LOOP_MICROBATCHES)
    loader = accelerator.prepare(loop_dataloader(world_size))
    dealt = [Batch(item["features"], item["labels"]).num_tokens for item in loader]
    expected = [mb.num_tokens for step in range(LOOP_STEPS) for mb in loop_step(step, rank)[1]]
    assert dealt == expected, (dealt, expected)
    outcome = {}
    for mode in ("plain", "count_first", "scale_after"):
        net = make_model(7)
        model, optimizer = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.5))
        unwrapped = accelerator.unwrap_model(model)
        recorder = StepRecorder(rank)
        reduction = "sum" if mode == "scale_after" else "mean"
        lw = AcceleratorAccumulator(accelerator, model, loss_reduction=reduction)
        window_losses: list[torch.Tensor] = []
        stream = (Batch(item["features"], item["labels"]) for item in loader)
        # Count first: one begin() per window of gradient_accumulation_steps microbatches.
        # Streaming, the loop runs on the prepared dataloader itself, so that accelerate ends
        # the short last step at the end of the data.
        windows = lw.windows(stream) if mode == "count_first" else [stream]
        for window in windows:
            if mode == "count_first":
                lw.begin(num_tokens=[mb.num_tokens for mb in window])
            for mb in window:
                with lw.accumulate() if mode != "plain" else accelerator.accumulate(model):
                    loss = microbatch_loss(model, mb, "tokens", reduction)
                    if mode == "plain":  # the mean loss as most loops give it to accelerate
                        loss = torch.nan_to_num(loss)
                        accelerator.backward(loss)
                        window_losses.append(loss.detach())
                        if accelerator.sync_gradients:  # logs the mean over ranks and steps
                            logged = accelerator.reduce(torch.stack(window_losses).mean(), "mean")
                            recorder.record(unwrapped, loss=logged.item())
                            window_losses = []
                    else:
                        counts = {"num_tokens": mb.num_tokens} if mode == "scale_after" else {}
                        accelerator.backward(lw.scale_loss(loss, **counts))
                        result = lw.end_if_sync()
                        if result is not None:
                            recorder.record(unwrapped, result)
                    optimizer.step()
                    optimizer.zero_grad()
        outcome[mode] = recorder.steps
    # loss_logging="next_step": the last step's loss comes with flush().
    lw = AcceleratorAccumulator(accelerator, model, loss_reduction="mean", loss_logging="next_step")
    recorder, window = StepRecorder(rank), loop_step(0, rank)[1]
    lw.begin(num_tokens=[mb.num_tokens for mb in window])
    for mb in window:
        with lw.accumulate():
            accelerator.backward(lw.scale_loss(microbatch_loss(model, mb, "tokens", "mean")))
            lw.end_if_sync()
    assert lw.result is not None
    lw.flush()
    recorder.record(unwrapped, lw.result)
    outcome["next_step"] = recorder.steps
    return outcome


# --------------------------------------------------------------------------------------------
# Lightning
# --------------------------------------------------------------------------------------------


def lightning_run(rank: int, world_size: int, tmp: str) -> dict:
    distributed_environment(rank, world_size)
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import Logger

    from lossweight.integrations.lightning import LossweightCallback

    class Module(pl.LightningModule):
        def __init__(self, automatic: bool, lw: LossweightCallback | None) -> None:
            super().__init__()
            self.net = make_model(7)
            self.lw = lw
            self.automatic_optimization = automatic

        def configure_callbacks(self) -> list:
            # The recorder reads the gradients in on_before_optimizer_step: after lossweight's
            # callback, which ends the step there (configure_callbacks' come after the
            # Trainer's own, in this order).
            return [self.lw, self.recorder] if self.lw is not None else [self.recorder]

        def training_step(self, batch: dict, batch_idx: int) -> Any:
            mb = Batch(batch["features"], batch["labels"])
            loss = microbatch_loss(self.net, mb, "tokens", "mean")
            if self.lw is None:  # the mean loss as most modules return and log it
                scaled = torch.nan_to_num(loss)
                self.log("train_loss", scaled, on_step=True, sync_dist=True, batch_size=1)
            else:
                scaled = self.lw.scale_loss(loss, num_tokens=mb.num_tokens)
            if self.automatic_optimization:
                return scaled
            optimizer = self.optimizers()
            self.manual_backward(scaled if self.lw is not None else scaled / LOOP_MICROBATCHES)
            if (batch_idx + 1) % LOOP_MICROBATCHES == 0 or self.trainer.is_last_batch:
                optimizer.step()
                optimizer.zero_grad()
            return None

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.5)

    class Recorder(pl.Callback):
        def __init__(self) -> None:
            self.recorder = StepRecorder(rank)

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            lw = pl_module.lw
            self.recorder.record(pl_module.net, lw.result if lw is not None else None)

    class Captured(Logger):
        """Every rank's logged metrics (Lightning calls a logger on every rank)."""

        def __init__(self) -> None:
            super().__init__()
            self.metrics: dict[int | None, dict] = {}

        name = "captured"
        version = "0"

        def log_metrics(self, metrics: dict, step: int | None = None) -> None:
            # Keyed by Lightning's step: the optimizer step in automatic optimization, the
            # batch in manual optimization (which logs after every batch).
            self.metrics.setdefault(step, {}).update(metrics)

        def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
            pass

    microbatches = [mb for step in range(LOOP_STEPS) for mb in loop_step(step, rank)[1]]
    data = [{"features": mb.features, "labels": mb.labels} for mb in microbatches]
    outcome = {}
    for name, automatic, weighted in [
        ("automatic/plain", True, False),
        ("automatic/lossweight", True, True),
        ("manual/plain", False, False),
        ("manual/lossweight", False, True),
    ]:
        lw = LossweightCallback(loss_reduction="mean") if weighted else None
        module, logger = Module(automatic, lw), Captured()
        module.recorder = recorder = Recorder()
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=world_size,
            strategy="ddp",
            max_steps=LOOP_STEPS,
            accumulate_grad_batches=LOOP_MICROBATCHES if automatic else 1,
            logger=logger,
            log_every_n_steps=1,
            use_distributed_sampler=False,  # each rank iterates its own microbatches
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            default_root_dir=f"{tmp}/lightning-{rank}",
        )
        loader = torch.utils.data.DataLoader(data, batch_size=None)
        trainer.fit(module, loader)
        # Lightning's logger step is the optimizer step in automatic optimization and the
        # batch in manual optimization, where the step's last batch logs its values.
        last_batches = [sum(LOOP_WINDOWS[: step + 1]) - 1 for step in range(LOOP_STEPS)]
        at = list(range(LOOP_STEPS)) if automatic else last_batches
        outcome[name] = {
            "steps": recorder.recorder.steps,
            "logged_at_steps": [logger.metrics.get(step, {}) for step in at],
            "every_logged_loss": [
                m["train_loss"] for m in logger.metrics.values() if "train_loss" in m
            ],
        }
    return outcome


def lightning_scheduled_run() -> list[tuple[int, int, float]]:
    """One process, no process group: Lightning's GradientAccumulationScheduler changes what
    it divides the loss by from one epoch to the next (4, then 2). Returns, per step, the
    epoch, the microbatches and the relative gradient error against their full batch."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    from lossweight.integrations.lightning import LossweightCallback

    generator = torch.Generator().manual_seed(5)
    microbatches = []
    for seed, rows in enumerate([3, 1, 2, 2, 1, 3]):
        lengths = torch.randint(1, 9, (rows,), generator=generator).tolist()
        microbatches.append(make_batch(lengths, max_length=8, seed=seed, left_padding=False))
    microbatches[4].labels[:] = IGNORE  # a microbatch without any target
    steps: list[tuple[int, int, float]] = []

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_model(3)
            self.lw = LossweightCallback(loss_reduction="mean")
            self.window: list[Batch] = []

        def configure_callbacks(self) -> list:
            return [self.lw, Check()]

        def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
            mb = Batch(batch["features"], batch["labels"])
            self.window.append(mb)
            loss = microbatch_loss(self.net, mb, "tokens", "mean")
            return self.lw.scale_loss(loss, num_tokens=mb.num_tokens)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.5)

    class Check(pl.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            window, pl_module.window = pl_module.window, []
            full = Batch(
                torch.cat([mb.features for mb in window]), torch.cat([mb.labels for mb in window])
            )
            _, expected = reference_gradients(
                pl_module.net, lambda m: microbatch_loss(m, full, "tokens", "mean")
            )
            error = max_relative_error(gradients(pl_module.net), expected)
            steps.append((trainer.current_epoch, len(window), error))

    loader = torch.utils.data.DataLoader(
        [{"features": mb.features, "labels": mb.labels} for mb in microbatches], batch_size=None
    )
    trainer = pl.Trainer(
        max_epochs=2,
        callbacks=[GradientAccumulationScheduler({0: 4, 1: 2})],
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Module(), loader)
    return steps


# --------------------------------------------------------------------------------------------
# Misuse of accelerate and Lightning, on one process
# --------------------------------------------------------------------------------------------

# Each window holds both ranks' microbatches of a loop step, so that its full batch is the
# step's global batch: uneven padding and a microbatch without a target, on one process.
MISUSE_STEPS = 2
MISUSE_WINDOW = 2 * LOOP_MICROBATCHES
# Well below the full-batch gradient's norm (checked by the tests): clipping is active.
CLIP = 0.05


def misuse_windows() -> list[tuple[Batch, list[Batch]]]:
    """Per step, the global batch and its microbatches (rank 0's, then rank 1's)."""
    return [
        (loop_step(step, 0)[0], loop_step(step, 0)[1] + loop_step(step, 1)[1])
        for step in range(MISUSE_STEPS)
    ]


def clipped_reference(model: torch.nn.Module, batch: Batch, clip: float | None) -> dict:
    """The full-batch gradient of ``batch``, clipped to the norm ``clip`` as the frameworks
    clip (torch.nn.utils.clip_grad_norm_), on a copy of the model, and its norm unclipped."""
    model = copy.deepcopy(model)
    microbatch_loss(model, batch, "tokens", "mean").backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip is not None else 1e300)
    return {"gradients": gradients(model), "norm": norm.item()}


def compared(model: torch.nn.Module, step: int, clip: float | None, result: Any) -> dict:
    """The model's gradient now against the clipped full-batch one of ``step``."""
    batch = misuse_windows()[step][0]
    expected = clipped_reference(model, batch, clip)
    return {
        "relative_error": max_relative_error(gradients(model), expected["gradients"]),
        "exact_norm": expected["norm"],
        "tokens": int(result.num_tokens),
        "expected_tokens": int(batch.num_tokens),
    }


def unchanged(model: torch.nn.Module, seed: int) -> bool:
    """Whether no optimizer step has changed the parameters of ``make_model(seed)``."""
    return all(map(torch.equal, model.parameters(), make_model(seed).parameters()))


def lightning_misuse_run(case: str, clip: float | None = None) -> dict:
    """Automatic optimization over MISUSE_STEPS windows of MISUSE_WINDOW microbatches, whose
    training_step uses the callback as ``case`` says: ``"documented"``; ``"validated"``, with
    a validation_step that calls the same helper and runs inside the windows; ``"raw"``,
    scaling the loss and returning the raw one; ``"unscaled"``, never calling scale_loss();
    ``"twice"``, scaling each loss a second time (for a log). Returns the gradients each
    optimizer step used (after Lightning's clipping), the error, if any, and whether the
    parameters moved."""
    import lightning.pytorch as pl

    from lossweight.integrations.lightning import LossweightCallback

    windows = misuse_windows()
    steps: list[dict] = []

    class Recording(torch.optim.SGD):
        """Records the gradient the update uses: after Lightning's closure, which runs the
        backward, ends lossweight's step and clips."""

        def step(self, closure: Any = None) -> Any:
            if closure is not None:
                with torch.enable_grad():
                    closure()
            steps.append(compared(module.net, len(steps), clip, module.lw.result))
            return super().step()

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_model(7)
            self.lw = LossweightCallback(loss_reduction="mean")
            self.validation_returned: list[bool] = []

        def configure_callbacks(self) -> list:
            return [self.lw]

        def losses(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
            """The helper that training_step and validation_step share: the microbatch's mean
            loss, and what scale_loss() makes of it."""
            mb = Batch(batch["features"], batch["labels"])
            loss = microbatch_loss(self.net, mb, "tokens", "mean")
            return loss, self.lw.scale_loss(loss, num_tokens=mb.num_tokens)

        def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
            if case == "unscaled":
                mb = Batch(batch["features"], batch["labels"])
                return microbatch_loss(self.net, mb, "tokens", "mean")
            loss, scaled = self.losses(batch)
            if case == "twice":
                self.losses(batch)
            return loss if case == "raw" else scaled

        def validation_step(self, batch: dict, batch_idx: int) -> None:
            loss, scaled = self.losses(batch)
            self.validation_returned.append(scaled is loss)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return Recording(self.parameters(), lr=0.5)

    items = [
        {"features": mb.features, "labels": mb.labels} for _, window in windows for mb in window
    ]
    loader = torch.utils.data.DataLoader(items, batch_size=None)
    validated = case == "validated"
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=MISUSE_STEPS,
        accumulate_grad_batches=MISUSE_WINDOW,
        gradient_clip_val=clip,
        # Validation after every 3rd batch: inside the windows of 8, never at their ends.
        val_check_interval=3 if validated else None,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    module = Module()
    error = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            trainer.fit(module, loader, loader if validated else None)
        except RuntimeError as raised:
            error = str(raised)
    return {
        "steps": steps,
        "error": error,
        "unchanged": unchanged(module.net, 7),
        "validation_returned": module.validation_returned,
    }


def accelerate_misuse_run(rank: int, world_size: int) -> dict:
    """One process, scale after, a fresh Accelerator per case: the documented loop with
    clipping, and the loop without end_if_sync(), with it before the last backward, and
    without it and with an optimizer that accelerate did not prepare."""
    from accelerate import Accelerator

    from lossweight.integrations.accelerate import AcceleratorAccumulator

    warnings.filterwarnings("ignore")
    outcome = {}
    for case in ("documented", "no_end", "end_before_backward", "no_end_unprepared"):
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=MISUSE_WINDOW)
        net = make_model(7)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
        if case == "no_end_unprepared":
            model = accelerator.prepare(net)
        else:
            model, optimizer = accelerator.prepare(net, optimizer)
        lw = AcceleratorAccumulator(accelerator, model, loss_reduction="sum")
        steps: list[dict] = []
        blocks = 0  # the accumulate() blocks entered
        try:
            for _, window in misuse_windows():
                for mb in window:
                    with lw.accumulate():
                        blocks += 1
                        loss = microbatch_loss(model, mb, "tokens", "sum")
                        scaled = lw.scale_loss(loss, num_tokens=mb.num_tokens)
                        if case == "end_before_backward":
                            lw.end_if_sync()
                        accelerator.backward(scaled)
                        if case == "documented" and lw.end_if_sync() is not None:
                            accelerator.clip_grad_norm_(model.parameters(), CLIP)
                            steps.append(compared(model, len(steps), CLIP, lw.result))
                        if accelerator.sync_gradients:  # as a loop does for a plain optimizer
                            optimizer.step()
                            optimizer.zero_grad()
            error = None
        except RuntimeError as raised:
            error = str(raised)
        outcome[case] = {
            "steps": steps,
            "error": error,
            "blocks": blocks,
            "unchanged": unchanged(model, 7),
        }
    return outcome


def hf_refusals_run(rank: int, world_size: int, tmp: str) -> dict[str, str]:
    """LossweightTrainer's refusals, in a process of its own (a Trainer's Accelerator state is
    process-wide): batches it cannot count, parallelism it cannot weight over, and a training
    step whose loss no step weighted."""
    from transformers import TrainingArguments

    from lossweight.integrations.hf import LossweightTrainer

    warnings.filterwarnings("ignore")
    model = torch.nn.Linear(2, 2)

    def arguments(kind: type[TrainingArguments] = TrainingArguments) -> TrainingArguments:
        return kind(output_dir=tmp, use_cpu=True, report_to=[])

    class TensorParallel(LossweightTrainer):
        def get_tp_size(self) -> int:
            return 2

    class TwoDevices(TrainingArguments):
        """One process driving two GPUs, which Trainer wraps in nn.DataParallel."""

        @property
        def n_gpu(self) -> int:
            return 2

    class Unscaled(LossweightTrainer):
        """A compute_loss that bypasses the Accumulator."""

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return model(inputs["x"]).sum()

    refused = {}

    def attempt(case: str, run: Any) -> None:
        try:
            run()
            refused[case] = "nothing"
        except (TypeError, ValueError, RuntimeError, NotImplementedError) as raised:
            refused[case] = f"{type(raised).__name__}: {raised}"

    trainer = LossweightTrainer(model=model, args=arguments())
    cpu = torch.device("cpu")
    attempt("not_a_dict", lambda: trainer.get_batch_samples(iter([("ids",)]), 1, cpu))
    no_labels = {"attention_mask": torch.ones(1, 2)}
    attempt("no_labels", lambda: trainer.get_batch_samples(iter([no_labels]), 1, cpu))
    attempt("tensor_parallel", lambda: TensorParallel(model=model, args=arguments()))
    attempt("data_parallel", lambda: LossweightTrainer(model=model, args=arguments(TwoDevices)))
    unscaled = Unscaled(model=model, args=arguments())
    attempt("outside_step", lambda: unscaled.training_step(model, {"x": torch.ones(1, 2)}))
    return refused


def accelerate_refusals_run(rank: int, world_size: int) -> dict[str, str]:
    """The AcceleratorAccumulator's refusals before its step: an Accelerator that sees one
    process on a default group of ``world_size`` ranks, a model never given, and
    gradient_accumulation_steps changed after construction."""
    from accelerate import Accelerator

    from lossweight.integrations.accelerate import AcceleratorAccumulator

    warnings.filterwarnings("ignore")
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=MISUSE_WINDOW)
    model = accelerator.prepare(make_model(7))
    _, (mb, *_) = misuse_windows()[0]
    refused = {}
    for case in ("other_world", "no_model", "steps_changed"):
        lw = AcceleratorAccumulator(
            accelerator, None if case == "no_model" else model, loss_reduction="sum"
        )
        if case == "steps_changed":
            accelerator.gradient_accumulation_steps = MISUSE_WINDOW + 1
        try:
            with lw.accumulate():
                lw.scale_loss(microbatch_loss(model, mb, "tokens", "sum"), num_tokens=mb.num_tokens)
            refused[case] = "nothing"
        except (RuntimeError, ValueError) as raised:
            refused[case] = f"{type(raised).__name__}: {raised}"
    return refused


def accelerate_under_deepspeed_run(rank: int, world_size: int, port: int) -> str:
    """A scale-after step under accelerate's DeepSpeed engine, in a process of its own (an
    Accelerator's state is process-wide): refused at its first scale_loss()."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        ACCELERATE_USE_DEEPSPEED="true",
    )
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    from lossweight.integrations.accelerate import AcceleratorAccumulator

    warnings.filterwarnings("ignore")
    plugin = DeepSpeedPlugin(zero_stage=0, gradient_accumulation_steps=MISUSE_WINDOW)
    accelerator = Accelerator(deepspeed_plugin=plugin)
    model = make_model(7)
    lw = AcceleratorAccumulator(accelerator, model, loss_reduction="sum")
    _, (mb, *_) = misuse_windows()[0]
    try:
        lw.scale_loss(microbatch_loss(model, mb, "tokens", "sum"), num_tokens=mb.num_tokens)
    except RuntimeError as raised:
        return str(raised)
    return "nothing"


# --------------------------------------------------------------------------------------------
# torch.compile
# --------------------------------------------------------------------------------------------

COMPILE_ROWS = 3  # every microbatch padded to this many rows, so that its shapes never change


def compile_run(rank: int, world_size: int) -> dict:
    """A hand-written count-first loop whose microbatch function (model, loss, scale_loss) is
    compiled with fullgraph=True; the gradients are averaged over the ranks as DDP does."""
    import torch._dynamo.testing
    import torch.distributed as dist

    from lossweight import Accumulator
    from lossweight.testing import count_collectives

    torch.set_num_threads(1)
    model = make_model(7)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    acc = Accumulator(loss_reduction="mean")

    def microbatch(features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return acc.scale_loss(microbatch_loss(model, Batch(features, labels), "tokens", "mean"))

    def padded(step: int) -> list[Batch]:
        # Rows of padding only change nothing: they hold no token.
        microbatches = loop_step(step, rank)[1]
        return [
            Batch(
                F.pad(mb.features, (0, 0, 0, 0, 0, COMPILE_ROWS - mb.num_samples)),
                F.pad(mb.labels, (0, 0, 0, COMPILE_ROWS - mb.num_samples), value=IGNORE),
            )
            for mb in microbatches
        ]

    # What dynamo sees, on a first step that only explains: a step's first microbatch (which
    # waits for the count reduction) and a later one.
    explained = []
    microbatches = padded(0)
    acc.begin(num_tokens=[mb.num_tokens for mb in microbatches])
    for mb in microbatches:
        explanation = torch._dynamo.explain(microbatch)(mb.features, mb.labels)
        explained.append(
            {
                "graphs": explanation.graph_count,
                "breaks": explanation.graph_break_count,
                "reasons": [str(reason.reason) for reason in explanation.break_reasons],
                "code": "\n".join(graph.code for graph in explanation.graphs),
            }
        )
    acc.abandon()
    torch._dynamo.reset()

    backend = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(microbatch, backend=backend, fullgraph=True)
    passes, graphs, collectives = [], [], []
    for _ in range(2):  # the same steps twice: the second must compile nothing
        recorder = StepRecorder(rank)
        for step in range(LOOP_STEPS):
            microbatches = padded(step)
            with count_collectives() as seen:
                acc.begin(num_tokens=[mb.num_tokens for mb in microbatches])
            for mb in microbatches:
                compiled(mb.features, mb.labels).backward()
            for parameter in model.parameters():
                assert parameter.grad is not None
                dist.all_reduce(parameter.grad)
                parameter.grad /= world_size
            with count_collectives() as seen_in_end:
                result = acc.end()
            recorder.record(model, result)
            collectives.append({"begin": dict(seen.calls), "end": dict(seen_in_end.calls)})
            optimizer.step()
            optimizer.zero_grad()
        passes.append(recorder.steps)
        graphs.append(backend.frame_count)
    # Ranks that disagree (rank 1 sums the gradients where rank 0 averages them): the check
    # inside the graph fails on every rank.
    torch._dynamo.reset()
    disagreeing = Accumulator(loss_reduction="mean", grad_reduction=("mean", "sum")[rank])

    def disagreeing_microbatch(features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = microbatch_loss(model, Batch(features, labels), "tokens", "mean")
        return disagreeing.scale_loss(loss)

    microbatches = padded(0)
    disagreeing.begin(num_tokens=[mb.num_tokens for mb in microbatches])
    try:
        torch.compile(disagreeing_microbatch, fullgraph=True)(
            microbatches[0].features, microbatches[0].labels
        )
        disagreement = None
    except RuntimeError as error:
        disagreement = str(error)
    return {
        "explained": explained,
        "passes": passes,
        "compiled_graphs": graphs,
        "collectives": collectives,
        "disagreement": disagreement,
    }
