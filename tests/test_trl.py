"""lossweight.integrations.trl: TRL's real GRPOTrainer on 2 gloo ranks, and its refusals.

The 2-rank launch (tests/trl_workers.py) trains every case with LossweightGRPOTrainer and with
GRPOTrainer on sampled completions of uneven lengths, and compares each step's gradient and
logged loss with the loss type's definition over the whole step in fp64. TRL computes the
log-probabilities in float32 (its fused LM-head kernel does, whatever the model's dtype), so
the gradients agree to float32's precision, not fp64's; GRPOTrainer alone is visibly off where
it normalises inside a microbatch or over another step.
"""

from __future__ import annotations

import copy
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from . import trl_workers as workers
from .gloo import run_ranks, values
from .torch_range import TORCH

if sys.version_info < (3, 11):  # trl needs 3.11; the test extra installs it from there on
    pytest.skip("trl needs Python 3.11 or later", allow_module_level=True)

WORLD_SIZE = 2
FP32 = 1e-6  # TRL's log-probabilities are float32
# Far above float32's agreement: GRPOTrainer alone is 4e-3 to 9e-3 off on the completions
# sampled on torch 2.6, more on torch 2.13's.
VISIBLY_OFF = 1e-3


@pytest.fixture(scope="module")
def grpo() -> list[dict]:
    # About 15 s on 2 cores (22 GRPOTrainer runs per rank); the deadline only stops a hang.
    with tempfile.TemporaryDirectory() as tmp:
        workers.save_model(f"{tmp}/model")
        return values(run_ranks(WORLD_SIZE, workers.grpo_run, tmp, deadline=240))


def test_the_completions_are_uneven_with_an_empty_microbatch(grpo: list[dict]) -> None:
    for name in workers.CASES:
        tokens = [outcome[f"{name}/lossweight"]["microbatch_tokens"] for outcome in grpo]
        assert len({count for rank in tokens for count in rank}) > 2, tokens
        assert tokens[0] != tokens[1]
        # Both trainers saw the same completions.
        assert tokens == [outcome[f"{name}/trl"]["microbatch_tokens"] for outcome in grpo]
    masked = [outcome["grpo-kl-masked/lossweight"]["microbatch_tokens"] for outcome in grpo]
    assert 0.0 in masked[0] + masked[1]


@pytest.mark.parametrize("name", list(workers.CASES))
def test_grpo_gradient_and_loss_equal_the_definition_over_the_step(
    grpo: list[dict], name: str
) -> None:
    for outcome in grpo:
        seen = outcome[f"{name}/lossweight"]
        assert max(seen["relative_errors"]) < FP32, seen["relative_errors"]
        for logged, expected in zip(seen["logged_losses"], seen["expected_losses"], strict=True):
            # The total, then each term, logged as "loss/<term>" when there are several.
            terms = (
                1 + ("beta" in workers.CASES[name][0]) + ("entropy_coef" in workers.CASES[name][0])
            )
            assert len(logged) == (1 if terms == 1 else 1 + terms)
            for value, want in zip(logged, expected, strict=True):
                # Absolute below 1: a GRPO loss is a sum of terms of order 1 that nearly cancel
                # (the advantages of a group sum to 0), so float32 leaves about 1e-8 anywhere.
                assert abs(value - want) < FP32 * max(1.0, abs(want)), (value, want)
    assert (
        grpo[0][f"{name}/lossweight"]["logged_losses"]
        == (grpo[1][f"{name}/lossweight"]["logged_losses"])
    )


@pytest.mark.parametrize("name", list(workers.CASES))
def test_grpo_trainer_alone_is_off_where_it_normalises_by_part(grpo: list[dict], name: str) -> None:
    # The data tell right from wrong: GRPOTrainer is exact where its normaliser is the step's,
    # and visibly off where it is a microbatch's (the entropy bonus) or two steps' mean.
    alone = workers.CASES[name][1]
    if name == "dapo-two-steps-per-generation" and TORCH < "2.7":
        pytest.skip(
            "on the completions sampled with torch 2.6, GRPOTrainer alone is within float32 "
            "here (1.6e-7): these data do not tell it apart on that torch"
        )
    for outcome in grpo:
        seen = outcome[f"{name}/trl"]
        worst = max(seen["relative_errors"])
        if alone == "exact":
            assert worst < FP32, seen["relative_errors"]
        else:
            assert worst > VISIBLY_OFF, seen["relative_errors"]


@pytest.mark.parametrize("name", list(workers.SAME_AS_TRL))
def test_per_token_losses_are_grpo_trainers_where_it_is_exact(grpo: list[dict], name: str) -> None:
    # One microbatch of equal rows per rank: GRPOTrainer's normalisers are the step's, so the
    # two trainers' gradients differ only by the per-token losses, which must be the same (to
    # the order of float32 sums: TRL's per-token losses are float32).
    for outcome in grpo:
        assert max(outcome[f"same/{name}"]) < FP32, outcome[f"same/{name}"]


# ------------------------------------------------------------------------------------------
# What LossweightGRPOTrainer refuses, in one process
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny() -> Iterator[dict[str, Any]]:
    from datasets import Dataset
    from transformers import LlamaForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        workers.save_model(f"{tmp}/model")
        yield {
            "tmp": tmp,
            "model": LlamaForCausalLM.from_pretrained(f"{tmp}/model"),
            "tokenizer": workers.tokenizer(),
            "prompts": Dataset.from_dict({"prompt": workers.PROMPTS}),
        }


def trainer(tiny: dict[str, Any], cls: type | None = None, **options: Any) -> Any:
    from trl import GRPOConfig

    from lossweight.integrations.trl import LossweightGRPOTrainer

    defaults = {"per_device_train_batch_size": 4, "num_generations": 4, "max_steps": 2}
    args = GRPOConfig(
        output_dir=f"{tiny['tmp']}/out",
        max_completion_length=4,
        use_cpu=True,
        bf16=False,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        **{**defaults, **options},
    )
    return (cls or LossweightGRPOTrainer)(
        model=copy.deepcopy(tiny["model"]),
        reward_funcs=workers.reward,
        args=args,
        train_dataset=tiny["prompts"],
        processing_class=tiny["tokenizer"],
    )


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"loss_type": "bnpo"}, "loss_type='dapo' is the same loss normalised by the whole step"),
        ({"loss_type": "vespo"}, "does not support loss_type='vespo'; pass one of dapo, cispo"),
        ({"top_entropy_quantile": 0.5}, "does not support top_entropy_quantile=0.5"),
        ({"off_policy_mask_threshold": 0.1}, "does not support off_policy_mask_threshold=0.1"),
        (
            {"use_adaptive_entropy": True, "entropy_coef": 0.01},
            "does not support use_adaptive_entropy=True",
        ),
        (
            {"gradient_accumulation_steps": 2, "steps_per_generation": 3},
            "steps_per_generation (3) to be a multiple of gradient_accumulation_steps (2)",
        ),
        (
            {"importance_sampling_level": "sequences"},
            "importance_sampling_level='sequences'; pass 'token' or 'sequence'",
        ),
    ],
)
def test_what_it_cannot_vouch_for_is_refused_by_name(
    tiny: dict[str, Any], options: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError) as raised:
        trainer(tiny, **options)
    assert message in str(raised.value)


def test_a_router_auxiliary_loss_is_refused(tiny: dict[str, Any]) -> None:
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=len(workers.WORDS), hidden_size=16, intermediate_size=16,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
        num_local_experts=2, num_experts_per_tok=1, output_router_logits=True,
        router_aux_loss_coef=0.01, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    # The model's config turns it on; the message names the value in use and the fix.
    with pytest.raises(ValueError) as raised:
        trainer({**tiny, "model": MixtralForCausalLM(config)})
    assert "router_aux_loss_coef=0.01" in str(raised.value)
    assert "set router_aux_loss_coef=0.0 in the GRPOConfig" in str(raised.value)


def test_an_override_of_compute_loss_is_refused(tiny: dict[str, Any]) -> None:
    # Training computes GRPOTrainer's loss itself: an override would be silently ignored.
    from lossweight.integrations.trl import LossweightGRPOTrainer

    class Custom(LossweightGRPOTrainer):
        def _compute_loss(self, model: Any, inputs: Any) -> Any:
            return super()._compute_loss(model, inputs) * 0

    with pytest.raises(TypeError, match="Custom overrides _compute_loss"):
        trainer(tiny, Custom)


def test_an_entropy_bonus_switched_on_after_construction_is_refused(
    tiny: dict[str, Any],
) -> None:
    grpo = trainer(tiny)
    grpo.entropy_coef = 0.1  # as a schedule in a callback might
    with pytest.raises(ValueError, match=r"entropy_coef is 0\.1, and was 0 when"):
        grpo.train()


class Change:
    """A callback that sets an option on the trainer as its second optimizer step begins, as a
    schedule would, and keeps the parameters then (``at_change``)."""

    def __new__(cls, trainer: Any, option: str, value: Any) -> Any:
        from transformers import TrainerCallback

        class Changing(TrainerCallback):
            def __init__(self) -> None:
                self.at_change: list[torch.Tensor] = []

            def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                if state.global_step == 1:
                    self.at_change = [p.detach().clone() for p in trainer.model.parameters()]
                    setattr(trainer, option, value)

        return Changing()


@pytest.mark.parametrize(
    ("built", "option", "value", "message"),
    [
        # Before: TRL failed on the reference model it never made (an AttributeError).
        ({}, "beta", 0.04, "beta is 0.04, and was 0 when this LossweightGRPOTrainer was built"),
        # Before: trained on, normalised by the step's tokens where "grpo" counts completions.
        (
            {"loss_type": "dapo"},
            "loss_type",
            "grpo",
            "loss_type is 'grpo', and was 'dapo' when this LossweightGRPOTrainer was built",
        ),
        ({"loss_type": "grpo"}, "loss_type", "bnpo", "does not take loss_type='bnpo'"),
    ],
)
def test_an_option_changed_by_a_callback_is_refused_before_it_trains(
    tiny: dict[str, Any], built: dict[str, Any], option: str, value: Any, message: str
) -> None:
    grpo = trainer(tiny, **built)
    change = Change(grpo, option, value)
    grpo.add_callback(change)
    with pytest.raises(ValueError) as raised:
        grpo.train()
    assert message in str(raised.value)
    # The first step trained; the second was refused before its update.
    assert grpo.state.global_step == 1 and change.at_change
    now = list(grpo.model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(change.at_change, now, strict=True))


def test_a_loss_type_of_the_same_normaliser_may_change(tiny: dict[str, Any]) -> None:
    grpo = trainer(tiny, loss_type="dapo", logging_steps=1)
    grpo.add_callback(Change(grpo, "loss_type", "cispo"))
    grpo.train()
    assert grpo.state.global_step == 2


def test_a_step_cut_short_makes_the_next_one_fail_instead_of_mixing_steps(
    tiny: dict[str, Any],
) -> None:
    # An exception after the first of 2 microbatches: GRPOTrainer's buffer is then one
    # microbatch ahead of Trainer's optimizer steps, and training on must not mix them.
    from transformers import TrainerCallback

    class Interrupt(TrainerCallback):
        def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            raise KeyboardInterrupt

    grpo = trainer(tiny, gradient_accumulation_steps=2, per_device_train_batch_size=2)
    grpo.add_callback(Interrupt())
    with pytest.raises(KeyboardInterrupt):
        grpo.train()
    grpo.remove_callback(Interrupt)
    with pytest.raises(RuntimeError, match="stopped before its last microbatch"):
        grpo.train()


def test_a_microbatch_other_than_the_counted_one_fails_loudly(tiny: dict[str, Any]) -> None:
    # The step begins with the counts of the buffered microbatches; should TRL hand the loss
    # another microbatch than the one counted, the count given with its loss disagrees.
    from lossweight.integrations.trl import LossweightGRPOTrainer

    class Shifted(LossweightGRPOTrainer):
        def _prepare_inputs(self, generation_batch: Any) -> Any:
            super()._prepare_inputs(generation_batch)
            return self._buffered_inputs[(self._step + 1) % self.args.steps_per_generation]

    shifted = trainer(tiny, Shifted, gradient_accumulation_steps=4, per_device_train_batch_size=2)
    with pytest.raises(RuntimeError, match="not the one begin\\(\\) declared"):
        shifted.train()
