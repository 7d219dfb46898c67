"""What each process of tests/test_trl.py runs: TRL's real GRPOTrainer on real gloo ranks.

``grpo_run(rank, world_size, tmp)`` trains a tiny fp64 Llama (saved to disk, as TRL builds its
reference model from the path) with a rule-based reward, in every configuration of
:data:`CASES`, with ``LossweightGRPOTrainer`` and with ``GRPOTrainer``. The completions are
sampled, so their lengths differ between microbatches and ranks, and with
``mask_truncated_completions`` some completions (and microbatches) have no counted token.
Each trainer records every microbatch it computes a loss for, the parameters at the start of
each optimizer step and the gradient just before it; after each run the ranks exchange their
microbatches, and each rank computes the step's loss and gradient from the loss type's
definition over all of them, in fp64 (:func:`reference`), to compare.
"""

from __future__ import annotations

import contextlib
import copy
import io
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .integration_workers import distributed_environment, fp64_throughout, gradients
from .problem import max_relative_error

WORDS = ["<pad>", "<eos>", "<unk>", "a", "b", "c", "d", "e"]  # EOS is likely: lengths vary
PROMPTS = ["a b", "c d e", "b", "e e a c", "d", "a a", "c", "b e d"]
STEPS = 2
# name: (GRPOConfig options, what GRPOTrainer alone does on these data)
CASES: dict[str, tuple[dict[str, Any], str]] = {
    # TRL's default: its token normaliser is the gathered count, exact when the generation
    # batch is the accumulated batch.
    "dapo": ({"loss_type": "dapo"}, "exact"),
    # Completions cut at max_completion_length are masked out: some have no counted token.
    "grpo-kl-masked": (
        {"loss_type": "grpo", "beta": 0.1, "mask_truncated_completions": True},
        "exact",
    ),
    "dr_grpo": ({"loss_type": "dr_grpo"}, "exact"),
    "luspo": ({"loss_type": "luspo", "importance_sampling_level": "sequence"}, "exact"),
    # GRPOTrainer takes the entropy's mean in each microbatch: off with uneven lengths.
    "dapo-entropy": ({"loss_type": "dapo", "entropy_coef": 0.5}, "off"),
    "grpo-entropy": ({"loss_type": "grpo", "entropy_coef": 0.5}, "off"),
    # One generation for two optimizer steps: GRPOTrainer normalises each step by their mean.
    "dapo-two-steps-per-generation": (
        {"loss_type": "dapo", "steps_per_generation": 4},
        "off",
    ),
    # A callback anneals the KL penalty to 0 for the second step (see CHANGED).
    "grpo-kl-annealed": ({"loss_type": "grpo", "beta": 0.1}, "exact"),
}
# name: {optimizer step: the options a callback sets on the trainer as the step begins}
CHANGED: dict[str, dict[int, dict[str, Any]]] = {"grpo-kl-annealed": {1: {"beta": 0.0}}}
# Compared with GRPOTrainer where it is exact by construction (one microbatch per rank, equal
# rows per rank): the per-token losses must be the same, option for option.
SAME_AS_TRL: dict[str, dict[str, Any]] = {
    "cispo": {"loss_type": "cispo"},
    "sapo": {"loss_type": "sapo"},
    "grpo-delta-kl-corrected": {
        "loss_type": "grpo",
        "beta": 0.1,
        "delta": 1.2,
        "use_bias_correction_kl": True,
        "epsilon": 0.05,
    },
    "grpo-sequence-ratio": {"loss_type": "grpo", "importance_sampling_level": "sequence"},
}


def tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=words, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def save_model(path: str) -> None:
    """The tiny Llama, saved once by the launching process: TRL builds the reference model
    (for ``beta``) from the model's path."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(WORDS),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=1,
    )
    LlamaForCausalLM(config).to(torch.float64).save_pretrained(path)


def reward(completions: list[str], **kwargs: Any) -> list[float]:
    return [completion.count("a") - 0.3 * len(completion.split()) for completion in completions]


def token_terms(model: torch.nn.Module, microbatch: dict[str, torch.Tensor]) -> dict:
    """One microbatch's log-probabilities and entropies of its completion tokens, by a plain
    forward of the fp64 model, and its mask."""
    completion = microbatch["completion_ids"]
    ids = torch.cat([microbatch["prompt_ids"], completion], dim=1)
    attention = torch.cat([microbatch["prompt_mask"], microbatch["completion_mask"]], dim=1)
    logits = model(input_ids=ids, attention_mask=attention).logits[:, -completion.size(1) - 1 : -1]
    log_probs = F.log_softmax(logits, dim=-1)
    return {
        "logps": log_probs.gather(-1, completion.unsqueeze(-1)).squeeze(-1),
        "entropy": -(log_probs.exp() * log_probs).sum(-1),
        "mask": microbatch["completion_mask"].to(torch.float64),
    }


def reference(
    model: torch.nn.Module, microbatches: list[dict[str, torch.Tensor]], options: dict[str, Any]
) -> tuple[dict[str, float], list[torch.Tensor]]:
    """Each term of the step's loss (and their sum, ``"loss"``) and the gradient of that sum,
    by the loss type's definition over all the step's completions (every microbatch of every
    rank): GRPO's clipped importance ratio (to the policy that generated them, or to the policy
    itself where TRL recorded none), the KL penalty with its importance-ratio correction (TRL's
    defaults) and the entropy bonus."""
    model = copy.deepcopy(model)
    kind, beta = options["loss_type"], options.get("beta", 0.0)
    low = options.get("epsilon", 0.2)
    high = options.get("epsilon_high") or low
    sums: dict[str, Any] = {"policy": 0.0, "kl": 0.0}
    tokens, rows, entropy = 0.0, 0, 0.0
    for microbatch in microbatches:
        terms = token_terms(model, microbatch)
        logps, mask = terms["logps"], terms["mask"]
        advantage = microbatch["advantages"].to(torch.float64).unsqueeze(1)
        old = microbatch.get("old_per_token_logps", logps.detach())
        log_ratio = logps - old
        if options.get("importance_sampling_level") == "sequence":
            log_ratio = (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, True).clamp(min=1)
        ratio = torch.exp(log_ratio)
        per_token = {
            "policy": -torch.min(ratio * advantage, ratio.clamp(1 - low, 1 + high) * advantage)
        }
        if beta:
            to_reference = microbatch["ref_per_token_logps"] - logps
            per_token["kl"] = beta * (torch.exp(to_reference) - to_reference - 1) * ratio
        for name, losses in per_token.items():
            losses = losses * mask
            if kind == "grpo":
                sums[name] = sums[name] + (losses.sum(-1) / mask.sum(-1).clamp(min=1)).sum()
            else:
                sums[name] = sums[name] + losses.sum()
        tokens += float(mask.sum())
        rows += mask.shape[0]
        entropy = entropy + (terms["entropy"] * mask).sum()
    normaliser = {
        "dapo": tokens,
        "grpo": rows,
        "dr_grpo": rows * options["max_completion_length"],
        "luspo": rows,
    }[kind]
    # A KL penalty annealed to 0 keeps its term, at 0.
    kept = ("policy", "kl") if "beta" in options else ("policy",)
    losses = {name: total / normaliser for name, total in sums.items() if name in kept}
    if options.get("entropy_coef", 0.0):
        losses["entropy"] = -options["entropy_coef"] * entropy / tokens
    loss = sum(losses.values())
    loss.backward()
    return {"loss": float(loss), **{name: float(value) for name, value in losses.items()}}, (
        gradients(model)
    )


def grpo_run(rank: int, world_size: int, tmp: str) -> dict:
    distributed_environment(rank, world_size)
    from datasets import Dataset
    from transformers import LlamaForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from lossweight.integrations.trl import LossweightGRPOTrainer

    base = fp64_throughout(LlamaForCausalLM.from_pretrained(f"{tmp}/model", dtype=torch.float64))
    words = tokenizer()
    prompts = Dataset.from_dict({"prompt": PROMPTS * 8})

    class Record(TrainerCallback):
        """The parameters as each optimizer step begins, and its gradient before the step."""

        def __init__(self, changes: dict[int, dict[str, Any]]) -> None:
            self.parameters: list[dict[str, torch.Tensor]] = []
            self.gradients: list[list[torch.Tensor]] = []
            self.changes, self.trainer = changes, None

        def on_step_begin(self, args, state, control, model=None, **kwargs):
            self.parameters.append({k: v.detach().clone() for k, v in model.state_dict().items()})
            for option, value in self.changes.get(state.global_step, {}).items():
                setattr(self.trainer, option, value)  # as a schedule in a callback would

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            self.gradients.append(gradients(model))

    def recording(cls: type) -> type:
        class Recording(cls):  # type: ignore[misc, valid-type]
            """Keeps a copy of every microbatch that a training loss is computed for."""

            def compute_loss(self, model, inputs, *args, **kwargs):
                if self.model.training:
                    self.seen.append(
                        (
                            self.state.global_step,
                            {
                                k: v.detach().clone()
                                for k, v in inputs.items()
                                if isinstance(v, torch.Tensor)
                            },
                        )
                    )
                return super().compute_loss(model, inputs, *args, **kwargs)

        return Recording

    def train(cls: type, name: str, options: dict[str, Any], microbatches: int) -> Any:
        rows = 8 // (world_size * microbatches)  # 8 completions a step: 2 prompts, 4 each
        args = GRPOConfig(
            output_dir=f"{tmp}/{name}-{rank}",
            per_device_train_batch_size=rows,
            gradient_accumulation_steps=microbatches,
            num_generations=4,
            max_completion_length=4,
            max_steps=STEPS,
            learning_rate=0.05,  # the second step's policy differs from the reference model's
            max_grad_norm=0.0,  # the gradient as the step made it
            bf16=False,  # TRL's default autocasts to bfloat16, on the CPU too
            seed=7,
            use_cpu=True,
            report_to=[],
            logging_steps=1,
            save_strategy="no",
            disable_tqdm=True,
            ddp_find_unused_parameters=False,
            **options,
        )
        record = Record(CHANGED.get(name, {}))
        trainer = recording(cls)(
            model=copy.deepcopy(base),
            reward_funcs=reward,
            args=args,
            train_dataset=prompts,
            processing_class=words,
            callbacks=[record],
        )
        trainer.seen, record.trainer = [], trainer
        with contextlib.redirect_stdout(io.StringIO()):
            trainer.train()
        return trainer, record

    def compare(trainer: Any, record: Any, name: str, options: dict[str, Any]) -> dict:
        """Each step's gradient and logged loss against the fp64 full-batch reference."""
        everyone: list[Any] = [None] * world_size
        dist.all_gather_object(everyone, trainer.seen)
        built = {"max_completion_length": 4, **options}
        errors, losses, expected, tokens, counted = [], [], [], [], []
        logs = [entry for entry in trainer.state.log_history if "loss" in entry]
        for step in range(STEPS):
            microbatches = [m for seen in everyone for s, m in seen if s == step]
            model = copy.deepcopy(base)
            model.load_state_dict(record.parameters[step])
            options = {**built, **CHANGED.get(name, {}).get(step, {})}
            terms, grads = reference(model, microbatches, options)
            errors.append(max_relative_error(record.gradients[step], grads))
            # The total, and each term's when there are several (lossweight logs them).
            names = [name for name in terms if name == "loss" or f"loss/{name}" in logs[step]]
            losses.append([logs[step]["loss" if n == "loss" else f"loss/{n}"] for n in names])
            expected.append([terms[name] for name in names])
            tokens.append(logs[step].get("loss_tokens"))
            counted.append(sum(float(m["completion_mask"].sum()) for m in microbatches))
        return {
            "relative_errors": errors,
            "logged_losses": losses,
            "expected_losses": expected,
            "logged_tokens": tokens,
            "expected_tokens": counted,
            "microbatch_tokens": [float(m["completion_mask"].sum()) for _, m in trainer.seen],
        }

    outcome: dict[str, Any] = {}
    for name, (options, _) in CASES.items():
        for kind, cls in (("lossweight", LossweightGRPOTrainer), ("trl", GRPOTrainer)):
            trainer, record = train(cls, name, options, microbatches=2)
            outcome[f"{name}/{kind}"] = compare(trainer, record, name, options)
    for name, options in SAME_AS_TRL.items():
        seen = {}
        for kind, cls in (("lossweight", LossweightGRPOTrainer), ("trl", GRPOTrainer)):
            trainer, record = train(cls, name, options, microbatches=1)
            seen[kind] = record.gradients
        outcome[f"same/{name}"] = [
            max_relative_error(ours, theirs)
            for ours, theirs in zip(seen["lossweight"], seen["trl"], strict=True)
        ]
    return outcome
