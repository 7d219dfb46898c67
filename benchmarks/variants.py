"""The ways of running a step's microbatches that the benchmark compares.

lossweight's modes beside a plain loop and re-creations of other trainers' per-step patterns,
made from their documented math (collectives, host syncs, gradient passes), not their code.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from lossweight import Accumulator, Term, count_tokens, token_cross_entropy

from .workload import token_mean_loss


class Variant:
    """One way to run a step's microbatches; ``step`` returns the step's logged loss."""

    name = ""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(self, microbatches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        raise NotImplementedError

    def backward_all(
        self,
        microbatches: list[tuple[torch.Tensor, torch.Tensor]],
        scaled: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Back-propagate ``scaled(loss_sum, count, labels)`` of each microbatch, with DDP's
        all-reduce on the last only; return the local detached loss sum and token count."""
        total_loss, total_count = 0.0, 0
        for index, (tokens, labels) in enumerate(microbatches):
            last = index == len(microbatches) - 1
            with contextlib.nullcontext() if last else self.model.no_sync():
                loss_sum, count = token_cross_entropy(self.model(tokens), labels, shift=True)
                scaled(loss_sum, count, labels).backward()
            total_loss, total_count = total_loss + loss_sum.detach(), total_count + count
        return total_loss, total_count


class Baseline(Variant):
    name = "baseline: loss / k"

    def step(self, microbatches):
        k = len(microbatches)
        logged = 0.0
        for index, (tokens, labels) in enumerate(microbatches):
            last = index == k - 1
            with contextlib.nullcontext() if last else self.model.no_sync():
                loss = token_mean_loss(self.model, tokens, labels) / k
                loss.backward()
            logged = logged + loss.detach()
        return logged


class BaselineAgain(Baseline):
    """The baseline once more: its ratio to the baseline shows the noise of the machine."""

    name = "baseline again (A/A control)"


class CountFirst(Variant):
    name = "lossweight count-first"

    def __init__(self, model):
        super().__init__(model)
        self.acc = Accumulator(weight_by="tokens", loss_reduction="sum", loss_logging="next_step")
        self.previous = None

    def step(self, microbatches):
        self.acc.begin(num_tokens=[count_tokens(labels, shift=True) for _, labels in microbatches])
        # The previous step's loss came with this step's counts.
        logged = (
            self.previous.loss
            if self.previous is not None
            else torch.zeros((), dtype=torch.float64)
        )
        self.backward_all(
            microbatches, lambda loss_sum, count, labels: self.acc.scale_loss(loss_sum)
        )
        self.previous = self.acc.end()
        return logged


class CountFirstLossInEnd(Variant):
    name = "lossweight count-first, loss in end()"

    def __init__(self, model):
        super().__init__(model)
        self.acc = Accumulator(weight_by="tokens", loss_reduction="sum")

    def step(self, microbatches):
        self.acc.begin(num_tokens=[count_tokens(labels, shift=True) for _, labels in microbatches])
        self.backward_all(
            microbatches, lambda loss_sum, count, labels: self.acc.scale_loss(loss_sum)
        )
        return self.acc.end().loss


class ScaleAfter(Variant):
    name = "lossweight scale-after"

    def __init__(self, model):
        super().__init__(model)
        self.acc = Accumulator(weight_by="tokens", loss_reduction="sum")

    def step(self, microbatches):
        self.acc.begin(parameters=self.model.parameters())
        self.backward_all(
            microbatches,
            lambda loss_sum, count, labels: self.acc.scale_loss(loss_sum, num_tokens=count),
        )
        return self.acc.end().loss


class CountFirstTerms(Variant):
    """Count first with ``loss_logging="next_step"``, the loss split into several terms of
    their own normalisers: the LM loss per token, then a mean per sequence, a sum over float
    weights, and a sum over a constant, each a small multiple of the LM loss."""

    terms = 2

    def __init__(self, model):
        super().__init__(model)
        kinds = [Term("lm", "sum"), Term("aux", "mean", "samples"), Term("kl", "sum", "weight_sum")]
        self.acc = Accumulator(
            terms=[*kinds, Term("dr", "sum", 1e4)][: self.terms], loss_logging="next_step"
        )
        self.previous = None

    def step(self, microbatches):
        counts = [count_tokens(labels, shift=True) for _, labels in microbatches]
        rows = [len(labels) for _, labels in microbatches]
        weights = [count.to(torch.float64) * 0.5 for count in counts]
        given = {"num_tokens": counts, "num_samples": rows, "weight_sum": weights}
        names = ("num_tokens", "num_samples", "weight_sum")[: min(self.terms, 3)]
        self.acc.begin(**{name: given[name] for name in names})
        logged = (
            self.previous.loss
            if self.previous is not None
            else torch.zeros((), dtype=torch.float64)
        )

        def scaled(loss_sum, count, labels):
            losses = {"lm": loss_sum, "aux": loss_sum * 1e-3 / len(labels)}
            losses |= {"kl": loss_sum * 5e-4, "dr": loss_sum * 1e-3}
            return self.acc.scale_loss({t.name: losses[t.name] for t in self.acc.options.terms})

        self.backward_all(microbatches, scaled)
        self.previous = self.acc.end()
        return logged


class CountFirstTwoTerms(CountFirstTerms):
    name = "lossweight count-first, 2 terms"
    terms = 2


class CountFirstFourTerms(CountFirstTerms):
    name = "lossweight count-first, 4 terms"
    terms = 4


class HFTrainerPattern(Variant):
    name = "HF Trainer pattern"

    def step(self, microbatches):
        world = dist.get_world_size()
        local = sum(count_tokens(labels, shift=True) for _, labels in microbatches)
        gathered = torch.empty(world, dtype=local.dtype, device=local.device)
        dist.all_gather_into_tensor(gathered, local.reshape(1))
        total = gathered.sum()
        logged = 0.0

        def scaled(loss_sum, count, labels):
            nonlocal logged
            loss = loss_sum / total * world
            if torch.isnan(loss):  # the per-microbatch NaN filter of the logged loss
                return loss
            logged = logged + loss.detach()
            return loss

        self.backward_all(microbatches, scaled)
        losses = torch.empty(world, device=local.device)
        dist.all_gather_into_tensor(losses, torch.as_tensor(logged, dtype=torch.float32).reshape(1))
        return losses.mean()


class ComposerPattern(Variant):
    name = "Composer pattern"

    def step(self, microbatches):
        world = dist.get_world_size()
        count = sum(count_tokens(labels, shift=True) for _, labels in microbatches)
        dist.all_reduce(count)
        total = count.item()
        loss_sum, _ = self.backward_all(
            microbatches, lambda loss_sum, count, labels: loss_sum / total * world
        )
        dist.all_reduce(loss_sum)  # one loss key
        return torch.tensor(loss_sum.item() / total)


class TorchtunePattern(Variant):
    name = "torchtune pattern"

    def step(self, microbatches):
        world = dist.get_world_size()
        loss_sum, count = self.backward_all(microbatches, lambda loss_sum, count, labels: loss_sum)
        dist.all_reduce(count)
        dist.all_reduce(loss_sum)
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        torch._foreach_mul_(grads, world / count)
        return torch.tensor(loss_sum.item() / count.item())


VARIANTS = [
    Baseline,
    BaselineAgain,
    CountFirst,
    CountFirstTwoTerms,
    CountFirstFourTerms,
    CountFirstLossInEnd,
    ScaleAfter,
    HFTrainerPattern,
    ComposerPattern,
    TorchtunePattern,
]
