"""lossweight.testing: the in-process group, the split-invariance checker and the strategies.

The checker must pass on correct loops (lossweight's two modes, a hand-written one) and fail,
with a report that names the likely cause, on the bugs the field shipped.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from lossweight import Accumulator, Term, aggregate, count_tokens, token_cross_entropy
from lossweight.collectives import ProcessGroupCollective
from lossweight.testing import (
    ContextShard,
    InProcessCollective,
    InProcessGroup,
    Split,
    assert_split_invariant,
    default_splits,
)
from lossweight.testing import strategies as lst

from . import gloo

VOCABULARY, LENGTH, IGNORE = 11, 8, -100
LENGTHS = [8, 2, 5, 0, 3, 7, 2, 6]  # real tokens per row; 0: a row that is all padding


def examples(
    lengths: list[int] = LENGTHS, seed: int = 0
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for real in lengths:
        tokens = torch.randint(0, VOCABULARY, (LENGTH,), generator=generator)
        rows.append((tokens, tokens.masked_fill(torch.arange(LENGTH) >= real, IGNORE)))
    return rows


def collate(rows: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    if not rows:
        empty = torch.zeros(0, LENGTH, dtype=torch.int64)
        return empty, empty.clone()
    return torch.stack([x for x, _ in rows]), torch.stack([y for _, y in rows])


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Embedding(VOCABULARY, 6), torch.nn.Tanh(), torch.nn.Linear(6, VOCABULARY)
    ).double()


def counts(lengths: list[int] = LENGTHS) -> list[int]:
    return [max(real - 1, 0) for real in lengths]  # the shifted targets of each row


# Correct loops.


def count_first(model, microbatches, collective):
    acc = Accumulator(loss_reduction="sum", collective=collective)
    acc.begin(num_tokens=[count_tokens(y, shift=True) for _, y in microbatches])
    for x, y in microbatches:
        loss_sum, _ = token_cross_entropy(model(x), y, shift=True)
        acc.scale_loss(loss_sum).backward()
    return acc.end()


def scale_after(model, microbatches, collective):
    acc = Accumulator(loss_reduction="sum", collective=collective)
    acc.begin(parameters=model.parameters())
    for x, y in microbatches:
        loss_sum, count = token_cross_entropy(model(x), y, shift=True)
        acc.scale_loss(loss_sum, num_tokens=count).backward()
    return acc.end()


def hand_written(model, microbatches, collective):
    """No Accumulator: the global count from the collective, the wrapper's average undone."""
    total = torch.zeros(1, dtype=torch.float64)
    for _, y in microbatches:
        total += count_tokens(y, shift=True)
    handle = collective.all_reduce_sum(total)
    if handle is not None:
        handle.wait()
    for x, y in microbatches:
        loss_sum, _ = token_cross_entropy(model(x), y, shift=True)
        (loss_sum * collective.world_size / total.clamp(min=1)).sum().backward()
    return None  # the gradient only


# The bugs.


def naive(model, microbatches, collective):
    """loss / accumulation_steps, with the empty microbatch's NaN zeroed as some trainers do."""
    logged = 0.0
    for x, y in microbatches:
        loss_sum, count = token_cross_entropy(model(x), y, shift=True)
        loss = torch.nan_to_num(loss_sum / count) / len(microbatches)
        loss.backward()
        logged += loss.item()
    return logged


def counts_padding(model, microbatches, collective):
    """Counts every non-padding token, while the mean loss covers the shifted targets only."""
    acc = Accumulator(loss_reduction="mean", collective=collective)
    acc.begin(num_tokens=[(y != IGNORE).sum() for _, y in microbatches])
    for x, y in microbatches:
        logits = model(x)
        loss = F.cross_entropy(
            logits[:, :-1].flatten(0, 1), y[:, 1:].flatten(), ignore_index=IGNORE
        )
        acc.scale_loss(loss).backward()
    return acc.end()


def sum_as_mean(model, microbatches, collective):
    """Passes token_cross_entropy's sum to an Accumulator told each loss is a mean."""
    acc = Accumulator(loss_reduction="mean", collective=collective)
    acc.begin(num_tokens=[count_tokens(y, shift=True) for _, y in microbatches])
    for x, y in microbatches:
        acc.scale_loss(token_cross_entropy(model(x), y, shift=True)[0]).backward()
    return acc.end()


def forgets_the_average(model, microbatches, collective):
    """Tells lossweight the wrapper sums the ranks' gradients, where it averages them."""
    acc = Accumulator(loss_reduction="sum", grad_reduction="sum", collective=collective)
    acc.begin(num_tokens=[count_tokens(y, shift=True) for _, y in microbatches])
    for x, y in microbatches:
        acc.scale_loss(token_cross_entropy(model(x), y, shift=True)[0]).backward()
    return acc.end()


def rank_local_count(model, microbatches, collective):
    """Divides by this rank's count only, as if it held the whole step."""
    total = sum(count_tokens(y, shift=True) for _, y in microbatches)
    for x, y in microbatches:
        loss_sum, _ = token_cross_entropy(model(x), y, shift=True)
        (loss_sum / max(int(total), 1)).backward()


@pytest.mark.parametrize("step", [count_first, scale_after, hand_written])
def test_correct_loops_pass(step) -> None:
    assert_split_invariant(step, model(), examples(), collate, counts=counts(), rtol=1e-10)


BUGS = {
    "naive": (naive, "1 rank: uneven microbatches", "this is what loss / accumulation_steps gives"),
    "counts_padding": (
        counts_padding,
        "1 rank: uneven microbatches",
        "weighted by counts other than those of the items their losses cover",
    ),
    # A mistake the Accumulator cannot see (a sum and a mean are both 0-dim tensors): the
    # checker is what catches it.
    "sum_as_mean": (
        sum_as_mean,
        "1 rank: uneven microbatches",
        "or a summed loss passed with loss_reduction='mean'",
    ),
    "forgets_the_average": (
        forgets_the_average,
        "2 ranks: sorted by count",
        "the gradient is 1/2 of the reference: the data-parallel average over the ranks is "
        "not undone",
    ),
    "rank_local_count": (
        rank_local_count,
        "2 ranks: sorted by count",
        "each rank weights its microbatches against its own total: the count is not reduced",
    ),
}


@pytest.mark.parametrize("bug", BUGS)
def test_each_bug_fails_with_a_report_of_its_cause(bug: str) -> None:
    step, split_name, cause = BUGS[bug]
    rows = examples([8, 2, 5, 3, 7, 2, 6, 4])  # no row of one token: a mean over none is NaN
    with pytest.raises(AssertionError) as failure:
        assert_split_invariant(
            step, model(), rows, collate, counts=counts([8, 2, 5, 3, 7, 2, 6, 4])
        )
    report = str(failure.value)
    assert report.startswith("the step depends on how its 8 examples are split"), report
    entry = re.search(rf"- '{re.escape(split_name)}'.*?likely cause: ([^\n]+)", report, re.S)
    assert entry is not None, report
    assert cause in entry.group(1), report
    assert "the gradient is off by" in report or "the gradient is" in report


def logs_its_own_mean(model, microbatches, collective):
    """Weights the gradient right, but logs this rank's own mean, never reduced over the ranks."""
    count_first(model, microbatches, collective)
    total = sum(int(count_tokens(y, shift=True)) for _, y in microbatches)
    losses = [token_cross_entropy(model(x), y, shift=True)[0] for x, y in microbatches]
    return float(sum(losses)) / total if total else 0.0


def test_a_logged_loss_wrong_beside_an_exact_gradient_is_blamed_on_the_log() -> None:
    # Before: blamed on counts other than those of the items the losses cover.
    rows = examples([8, 2, 5, 3, 7, 2, 6, 4])
    with pytest.raises(AssertionError) as failure:
        assert_split_invariant(
            logs_its_own_mean, model(), rows, collate, counts=counts([8, 2, 5, 3, 7, 2, 6, 4])
        )
    report = str(failure.value)
    entry = re.search(r"- '2 ranks: sorted by count'.*?likely cause: ([^\n]+)", report, re.S)
    assert entry is not None, report
    assert entry.group(1).startswith("the gradient agrees, the logged loss does not"), report
    assert "the gradient is off" not in report


def test_an_empty_microbatch_nan_is_reported() -> None:
    def unguarded(model, microbatches, collective):
        for x, y in microbatches:
            targets = y[:, 1:] != IGNORE
            log_probabilities = model(x)[:, :-1].log_softmax(-1)
            picked = log_probabilities.gather(-1, y[:, 1:].clamp(min=0).unsqueeze(-1))
            # A hand-written mean: 0 / 0, with a NaN backward, for a microbatch with no target.
            loss = -(picked.squeeze(-1) * targets).sum() / targets.sum()
            (loss / len(microbatches)).backward()

    with pytest.raises(AssertionError) as failure:
        assert_split_invariant(unguarded, model(), examples(), collate, counts=counts())
    report = str(failure.value)
    entry = re.search(
        r"- '2 ranks: a rank with no items'.*?\n(.*?)\n.*?likely cause: ([^\n]+)", report, re.S
    )
    assert entry is not None, report
    assert entry.group(1).strip() == "the gradient holds NaN or inf", report
    assert entry.group(2).startswith("an empty microbatch's mean over zero items"), report


def test_default_splits_are_partitions_with_the_hard_cases() -> None:
    splits = default_splits(counts())
    names = {split.name for split in splits}
    for size in (2, 3):
        hard = ("an empty microbatch", "a rank with no items", "a rank with no microbatch")
        assert {f"{size} ranks: {name}" for name in hard} <= names
    assert {len(split.ranks) for split in splits} == {1, 2, 3}
    for split in splits:
        items = sorted(i for rank in split.ranks for mb in rank for i in mb)
        assert items == list(range(len(LENGTHS))), split
    no_items = next(split for split in splits if split.name == "2 ranks: a rank with no items")
    assert [counts()[i] for mb in no_items.ranks[1] for i in mb] == [0]  # the all-padding row
    assert all(
        not any(len(mb) == 0 for rank in split.ranks for mb in rank) and all(split.ranks)
        for split in default_splits(counts(), empty_microbatches=False)
    )


def test_default_splits_of_a_world_size_have_that_many_ranks_and_need_enough_examples() -> None:
    splits = default_splits([1] * 6, world_size=4)
    assert len(splits) == 6 and {len(split.ranks) for split in splits} == {4}
    # With every count 1, each split still holds microbatches or ranks of different sizes.
    uneven = next(split for split in splits if split.name == "4 ranks: uneven microbatches")
    assert [len(mb) for mb in uneven.ranks[0]] == [1, 2]
    with pytest.raises(ValueError) as refused:
        default_splits([1] * 5, world_size=4)
    assert str(refused.value) == (
        "counts has 5 entries; the default splits of 4 ranks need at least 6 examples, one "
        "count each"
    )
    with pytest.raises(ValueError, match=r"world_size=0; pass a positive int, or None"):
        default_splits([1] * 6, world_size=0)


# What a check needs to compare something; what it refuses, and why.


def zero_gradient(model, microbatches, collective):
    """A loss that does not reach the parameters: every gradient is 0."""
    for x, y in microbatches:
        loss_sum, _ = token_cross_entropy(model(x), y, shift=True)
        (loss_sum * 0).backward()


def test_a_step_that_trains_a_model_of_its_own_fails_saying_why() -> None:
    trained = model()  # the step's own, as a module-level model would be
    optimizer = torch.optim.SGD(trained.parameters(), lr=0.5)

    def trains_its_own(_, microbatches, collective):
        optimizer.zero_grad()
        hand_written(trained, microbatches, collective)
        optimizer.step()  # the next run starts from the weights this one leaves

    with pytest.raises(AssertionError) as failure:
        assert_split_invariant(trains_its_own, trained, examples(), collate, counts=counts())
    assert str(failure.value).startswith(
        "the step changed the model passed to assert_split_invariant (parameter '0.weight' "
        "differs after a run), though every run gets a copy of it"
    )
    # Given another model, the step leaves the copies it gets untouched: zeros against zeros.
    with pytest.raises(AssertionError) as failure:
        assert_split_invariant(trains_its_own, model(), examples(), collate, counts=counts())
    assert str(failure.value).startswith(
        "the step left no gradient on the model it was given (the .grad of every parameter "
        "that requires one is None or 0 after the whole batch), so the check would compare "
        "nothing: it trains another model"
    )


def test_a_step_whose_gradient_is_zero_fails_saying_why() -> None:
    with pytest.raises(AssertionError, match=r"^the step left no gradient on the model it was"):
        assert_split_invariant(zero_gradient, model(), examples(), collate, counts=counts())


def test_splits_that_compare_nothing_are_refused() -> None:
    whole = Split.of("one microbatch", [[list(range(8))]])
    for splits, message in (
        ([], "splits is empty, so the check would compare nothing: give at least one Split"),
        ([whole], "every split in splits is the whole batch in one microbatch on one rank"),
    ):
        with pytest.raises(ValueError) as refused:
            assert_split_invariant(naive, model(), examples(), collate, splits=splits)
        assert str(refused.value).startswith(message)


def test_splits_that_do_not_hold_every_example_once_are_refused() -> None:
    whole = Split.of("2 microbatches", [[list(range(4)), list(range(4, 8))]])
    split = Split.of("mine", [[[0, 1, 2], [2, 3, 9]], [[4, 5, 6]]])
    with pytest.raises(ValueError) as refused:
        assert_split_invariant(count_first, model(), examples(), collate, splits=[whole, split])
    assert str(refused.value) == (
        "splits[1] ('mine') must hold each of examples 0 to 7 once: it misses [7], holds more "
        "than once [2], holds what is no example [9]"
    )


def test_a_batch_too_small_to_split_is_refused_naming_the_minimum() -> None:
    # One example fills every microbatch of every split alike: the naive loop passed.
    for size in (1, 4):
        with pytest.raises(ValueError) as refused:
            assert_split_invariant(naive, model(), examples()[:size], collate)
        assert str(refused.value).startswith(
            f"len(examples) is {size}; the default splits of 1, 2 and 3 ranks need at least 5 "
            "examples: give 5 or more"
        )
    single = Split.of("an empty microbatch", [[[0], []]])
    with pytest.raises(ValueError) as refused:
        assert_split_invariant(naive, model(), examples()[:1], collate, splits=[single])
    assert str(refused.value).endswith("nothing could differ: give at least 2 examples")
    with pytest.raises(AssertionError, match="loss / accumulation_steps"):
        assert_split_invariant(naive, model(), examples()[:5], collate, counts=counts()[:5])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"counts": [1] * 7}, "counts has 7 entries but examples has 8; give one count per"),
        ({"counts": [1, -1] * 4}, "counts[1]=-1 is negative; give each example's number of"),
        ({"rtol": float("nan")}, "rtol=nan; pass a finite number of 0 or more"),
    ],
)
def test_bad_arguments_are_refused_naming_them(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as refused:
        assert_split_invariant(count_first, model(), examples(), collate, **kwargs)
    assert str(refused.value).startswith(message)


def dropout_model(noise: bool = False) -> torch.nn.Module:
    """model() with a Dropout(0.5) in train mode, and with noise, a dropout called as a
    function, which no module shows."""

    class Noise(torch.nn.Module):
        def forward(self, hidden: torch.Tensor) -> torch.Tensor:
            return F.dropout(hidden, 0.5, training=noise)

    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Embedding(VOCABULARY, 6),
        torch.nn.Dropout(0.5),
        Noise(),
        torch.nn.Tanh(),
        torch.nn.Linear(6, VOCABULARY),
    ).double()


def test_a_correct_loop_with_dropout_in_train_mode_passes() -> None:
    # Each microbatch draws its masks for its own shape: compared as they were, the splits
    # differed by as much as the masks do, and the report blamed the counts.
    assert_split_invariant(count_first, dropout_model(), examples(), collate, counts=counts())


def test_a_report_names_the_dropout_run_in_eval_mode() -> None:
    with pytest.raises(AssertionError) as failure:
        assert_split_invariant(naive, dropout_model(), examples(), collate, counts=counts())
    report = str(failure.value)
    assert "this is what loss / accumulation_steps gives" in report, report
    assert report.endswith(
        "\n'1' (Dropout) ran in eval mode in every run: dropout's mask depends on the "
        "microbatch's shape, so no two splits would draw the same"
    )


def test_randomness_no_module_shows_is_reported_as_such() -> None:
    with pytest.raises(AssertionError) as failure:
        assert_split_invariant(
            count_first, dropout_model(noise=True), examples(), collate, counts=counts()
        )
    report = str(failure.value)
    assert report.startswith(
        "the step is not deterministic: two runs of the whole batch in one microbatch, from "
        "the same weights, differ: the gradient is off by"
    ), report
    assert report.endswith("(the checker already runs '1' (Dropout) in eval mode)"), report


class Normalized(torch.nn.Module):
    """model() with batch norm between the embedding and the output."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCABULARY, 6)
        self.norm = torch.nn.BatchNorm1d(6)
        self.out = torch.nn.Linear(6, VOCABULARY)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens)
        return self.out(self.norm(hidden.flatten(0, 1)).view_as(hidden).tanh())


def test_batch_norm_in_eval_mode_passes_and_in_train_mode_is_refused() -> None:
    normalized = Normalized().double()
    with pytest.raises(ValueError) as refused:
        assert_split_invariant(count_first, normalized, examples(), collate, counts=counts())
    assert str(refused.value).startswith(
        "model has batch norm in train mode, in 'norm' (BatchNorm1d): it normalizes each "
        "microbatch by that microbatch's statistics"
    )
    with torch.no_grad():
        normalized(collate(examples())[0])  # running statistics other than 0 and 1
    normalized.eval()
    assert_split_invariant(count_first, normalized, examples(), collate, counts=counts())


def test_a_frozen_layer_passes() -> None:
    frozen = model()
    frozen[2].requires_grad_(False)
    assert_split_invariant(scale_after, frozen, examples(), collate, counts=counts(), rtol=1e-10)


# The in-process group.


def reduce_once(rank: int, collective: InProcessCollective) -> list[float]:
    tensor = torch.full((1,), float(rank + 1), dtype=torch.float64)
    collective.all_reduce_sum(tensor).wait()
    return tensor.tolist()


def test_the_group_driven_from_one_thread_sums_every_rank_and_counts_the_calls() -> None:
    group = InProcessGroup(3)
    collectives = [group.collective(rank) for rank in range(3)]
    tensors = [torch.tensor([1.0, rank], dtype=torch.float64) for rank in range(3)]
    handles = [c.all_reduce_sum(t) for c, t in zip(collectives, tensors, strict=True)]
    tensors[0].fill_(100.0)  # a contribution is copied when it is made
    for handle in handles:
        handle.wait()
    assert [t.tolist() for t in tensors] == [[3.0, 3.0]] * 3
    assert group.calls == [1, 1, 1] and [c.calls for c in collectives] == [1, 1, 1]


def test_a_wait_from_one_thread_fails_at_once_before_every_rank_started_the_sum() -> None:
    group = InProcessGroup(2)  # a wait that blocked would fail after 60 s, with another message
    handle = group.collective(0).all_reduce_sum(torch.zeros(2, dtype=torch.float64))
    with pytest.raises(
        RuntimeError, match=r"rank 0 waited for all-reduce 0 before rank\(s\) \[1\] started it"
    ):
        handle.wait()
    group.collective(1).all_reduce_sum(torch.ones(2, dtype=torch.float64))
    handle.wait()  # complete now


def test_run_runs_a_call_that_waits_on_every_rank_and_mixes_with_one_thread() -> None:
    group = InProcessGroup(2)
    assert group.run(reduce_once) == [[3.0], [3.0]]
    # Then rank after rank from this thread: the calls carry on from run()'s, and back.
    tensors = [torch.ones(1), torch.full((1,), 4.0)]
    handles = [group.collective(rank).all_reduce_sum(t) for rank, t in enumerate(tensors)]
    for handle in handles:
        handle.wait()
    assert [t.tolist() for t in tensors] == [[5.0], [5.0]] and group.calls == [2, 2]
    assert group.run(reduce_once) == [[3.0], [3.0]] and group.calls == [3, 3]


def test_run_reports_at_once_a_rank_that_never_starts_the_sum() -> None:
    group = InProcessGroup(2)  # found when rank 1 returns, not after the 60 s timeout

    def rank_1_skips(rank: int, collective: InProcessCollective) -> list[float] | None:
        return reduce_once(rank, collective) if rank == 0 else None

    with pytest.raises(
        RuntimeError,
        match=r"all-reduce 0 of rank 0 can never complete: .* rank\(s\) \[1\] did not start it",
    ):
        group.run(rank_1_skips)


def test_run_bounds_a_wait_for_a_busy_rank_by_the_timeout() -> None:
    group = InProcessGroup(2, timeout=0.1)

    def rank_1_is_slow(rank: int, collective: InProcessCollective) -> list[float] | None:
        if rank == 0:
            return reduce_once(rank, collective)
        time.sleep(1.5)  # busy rather than waiting: no deadlock to see
        return None

    with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] did not start it within 0.1 s"):
        group.run(rank_1_is_slow)


def test_a_failed_run_leaves_the_group_clean() -> None:
    group = InProcessGroup(2)
    handles = []

    def rank_1_fails_first(rank: int, collective: InProcessCollective) -> None:
        if rank == 1:
            raise ValueError("rank 1 fails before its all-reduce")
        handles.append(collective.all_reduce_sum(torch.full((1,), 100.0, dtype=torch.float64)))
        handles[0].wait()

    with pytest.raises(ValueError, match="rank 1 fails before its all-reduce"):
        group.run(rank_1_fails_first)
    # Rank 1's next all-reduce paired with rank 0's 100 of the failed run, and rank 0's next
    # one waited for a partner in vain: the report blamed the step run next.
    assert group.run(reduce_once) == [[3.0], [3.0]]
    assert group.calls == [2, 1]
    with pytest.raises(
        RuntimeError,
        match=r"^all-reduce 0 of rank 0 was abandoned when a run of this group failed before "
        r"every rank started it",
    ):
        handles[0].wait()
    # Driven from one thread, the ranks pair up as well.
    tensors = [torch.ones(1), torch.full((1,), 4.0)]
    pending = [group.collective(rank).all_reduce_sum(t) for rank, t in enumerate(tensors)]
    for handle in pending:
        handle.wait()
    assert [t.tolist() for t in tensors] == [[5.0], [5.0]]


def test_a_wait_in_a_run_where_another_rank_failed_fails_at_once() -> None:
    group = InProcessGroup(2)
    seen = []

    def rank_1_fails(rank: int, collective: InProcessCollective) -> None:
        if rank == 1:
            raise ValueError("rank 1 fails before its all-reduce")
        try:
            collective.all_reduce_sum(torch.ones(1)).wait()
        except RuntimeError as waited:
            seen.append(str(waited))

    with pytest.raises(ValueError, match="rank 1 fails before its all-reduce"):
        group.run(rank_1_fails)
    # Whether rank 1 failed before or after rank 0 began to wait.
    assert seen == ["all-reduce 0 of rank 0 abandoned: another rank failed"]


def test_run_is_not_reentrant() -> None:
    group = InProcessGroup(1)
    with pytest.raises(RuntimeError, match="already running: it is not reentrant; call it"):
        group.run(lambda rank, collective: group.run(reduce_once))


def test_a_contribution_unlike_another_ranks_is_refused() -> None:
    group = InProcessGroup(2)
    group.collective(0).all_reduce_sum(torch.zeros(2, dtype=torch.float64))
    for tensor, kind in (
        (torch.zeros(2), "float32 tensor of shape (2,)"),
        (torch.zeros(3, dtype=torch.float64), "float64 tensor of shape (3,)"),
    ):
        with pytest.raises(RuntimeError) as refused:
            group.collective(1).all_reduce_sum(tensor)
        assert str(refused.value) == (
            f"all-reduce 0: rank 1 contributes a torch.{kind}, rank 0 a torch.float64 tensor "
            "of shape (2,); every rank must reduce tensors of the same shape and dtype in the "
            "same order, as a real process group requires"
        )
    assert group.calls == [1, 0]  # a refused contribution is not issued


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_the_strategies_draw_valid_splits_and_labels(data: st.DataObject) -> None:
    n = data.draw(st.integers(0, 12))
    ranks = data.draw(lst.splits(n))
    assert sorted(i for rank in ranks for mb in rank for i in mb) == list(range(n))
    assert 1 <= len(ranks) <= 4 and len(ranks[0]) >= 1
    labels = data.draw(lst.padded_labels(length=6))
    real = labels != IGNORE
    assert labels.shape[1] == 6 and labels.dtype == torch.int64
    # Padding is on one side: the real tokens of each row are consecutive from an end.
    for row in real:
        positions = row.nonzero().flatten().tolist()
        assert (
            positions == list(range(positions[0], positions[0] + len(positions)))
            if positions
            else True
        )
        assert not positions or positions[0] == 0 or positions[-1] == 5
    assert all(count >= 0 for count in data.draw(lst.counts()))


@settings(max_examples=60, deadline=None)
@given(lst.splits(8, max_ranks=3, max_microbatches=3), st.sampled_from([count_first, scale_after]))
def test_lossweight_is_split_invariant_on_drawn_splits(ranks, step) -> None:
    assume(len(ranks) > 1 or len(ranks[0]) > 1)  # the reference's own split is refused
    assert_split_invariant(
        step, model(), examples(), collate, splits=[Split.of("drawn", ranks)], rtol=1e-10
    )


GLOO_WORLD = 4  # none of the simulated worlds, of 1, 2 and 3 ranks


def _shards() -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    rows = examples()
    return [
        [collate(rows[:3]), collate([])],
        [collate(rows[3:5])],
        [collate(rows[5:7])],
        [collate(rows[7:])],
    ]


def _under_gloo(rank: int, world_size: int) -> dict:
    outcome = {}
    for name, step in (("count_first", count_first), ("naive", naive)):
        try:
            assert_split_invariant(step, model(), examples(), collate, counts=counts(), rtol=1e-10)
            outcome[name] = "passed"
        except AssertionError as failure:
            outcome[name] = str(failure)
    for name, kwargs in (
        ("other_world", {"splits": default_splits(counts())}),
        ("other_examples", {"counts": counts()[: 7 if rank == 3 else 8]}),
        ("context_parallel", {"context_parallel": 2}),
    ):
        rows = examples()[: len(kwargs.get("counts", LENGTHS))]
        try:
            assert_split_invariant(count_first, model(), rows, collate, **kwargs)
            outcome[name] = "passed"
        except ValueError as refused:
            outcome[name] = str(refused)
    outcome["loss"] = count_first(model(), _shards()[rank], ProcessGroupCollective()).loss.item()
    return outcome


@pytest.fixture(scope="module")
def under_gloo() -> list[dict]:
    return gloo.values(gloo.run_ranks(GLOO_WORLD, _under_gloo, deadline=90))


def test_the_simulated_group_agrees_with_real_gloo_ranks(under_gloo: list[dict]) -> None:
    real = under_gloo[0]
    assert all(outcome["count_first"] == real["count_first"] for outcome in under_gloo)
    assert real["count_first"] == "passed"
    # The same splits of 4 ranks in this process give the same report, to the printed digits.
    with pytest.raises(AssertionError) as failure:
        assert_split_invariant(
            naive,
            model(),
            examples(),
            collate,
            counts=counts(),
            splits=default_splits(counts(), world_size=GLOO_WORLD),
            rtol=1e-10,
        )
    assert all(outcome["naive"] == str(failure.value) for outcome in under_gloo)
    group = InProcessGroup(GLOO_WORLD)
    shards = _shards()
    replicas = [model() for _ in shards]  # made here: seeding in the threads would race
    simulated = group.run(
        lambda rank, collective: count_first(replicas[rank], shards[rank], collective)
    )
    assert [r.loss.item() for r in simulated] == [outcome["loss"] for outcome in under_gloo]


def test_under_torch_distributed_every_split_has_its_world_size(under_gloo: list[dict]) -> None:
    # The naive loop passed in a world of 4 processes while every default split had 1 to 3
    # ranks, and none of those could run on 4 processes: the check compared nothing.
    report = under_gloo[0]["naive"]
    assert report.startswith("the step depends on how its 8 examples are split: 6 of 6 splits")
    splits = re.findall(r"^- '([^']*)'", report, re.M)
    assert len(splits) == 6 and all(name.startswith("4 ranks: ") for name in splits), report
    assert "this is what loss / accumulation_steps gives" in report, report
    assert all(outcome["other_world"] == under_gloo[0]["other_world"] for outcome in under_gloo)
    assert under_gloo[0]["other_world"] == (
        "splits[0] ('1 rank: uneven microbatches') has 1 rank, but torch.distributed runs 4 "
        "processes, which are the ranks of every split: give splits of 4 ranks, or leave "
        "splits out for default_splits(counts, world_size=4)"
    )
    assert [outcome["context_parallel"] for outcome in under_gloo] == [
        "context_parallel=2 simulates ranks in one process, but torch.distributed runs 4 "
        "processes: run the check in one process"
    ] * GLOO_WORLD
    # Rank 3 passes 7 examples, the others 8: every rank refuses, none hangs.
    assert [outcome["other_examples"] for outcome in under_gloo] == [
        f"rank {3 if rank < 3 else 0} called assert_split_invariant with other examples and "
        f"counts than rank {rank} (as many examples, with the same counts and splits, must run "
        "on every process): every process passes the same arguments"
        for rank in range(GLOO_WORLD)
    ]


def test_only_the_strategies_import_hypothesis() -> None:
    code = (
        "import sys\n"
        "import lossweight\n"
        "assert 'lossweight.testing' not in sys.modules and 'hypothesis' not in sys.modules\n"
        "import lossweight.testing\n"
        "assert 'hypothesis' not in sys.modules\n"
        "import lossweight.testing.strategies\n"
        "assert 'hypothesis' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# count_collectives, on real gloo ranks.


def _collectives_seen(rank: int, world_size: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Partial, Replicate, init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    from lossweight.testing import count_collectives

    seen = {}
    with count_collectives() as plain:
        dist.all_reduce(torch.ones(5))  # 20 bytes
        dist.broadcast(torch.ones(2, dtype=torch.float64), src=0)  # 16 bytes
    seen["plain"] = [dict(plain.calls), dict(plain.bytes)]
    with count_collectives() as functional:
        group = dist.group.WORLD
        assert group is not None
        summed = torch.ops._c10d_functional.all_reduce(torch.ones(3), "sum", group.group_name)
        torch.ops._c10d_functional.wait_tensor(summed)  # no data moves: not counted
    seen["functional"] = [dict(functional.calls), dict(functional.bytes)]
    mesh = init_device_mesh("cpu", (world_size,))
    with count_collectives() as dtensor:
        partial = DTensor.from_local(torch.ones(4), mesh, [Partial()])
        partial.redistribute(mesh, [Replicate()]).to_local()  # one all-reduce of 16 bytes
    seen["dtensor"] = [dict(dtensor.calls), dict(dtensor.bytes)]
    model = DistributedDataParallel(torch.nn.Linear(3, 1))
    for _ in range(2):  # DDP rebuilds its buckets, and broadcasts their layout, at step 2
        model(torch.ones(2, 3)).sum().backward()
    with count_collectives() as ddp:
        model(torch.ones(2, 3)).sum().backward()
    seen["ddp"] = [dict(ddp.calls), dict(ddp.bytes)]
    return seen


def test_count_collectives_sees_every_path_to_the_backend() -> None:
    for seen in gloo.values(gloo.run_ranks(2, _collectives_seen, deadline=60)):
        calls = {"all_reduce": 1, "broadcast": 1}
        assert seen["plain"] == [calls, {"all_reduce": 20, "broadcast": 16}]
        assert seen["functional"] == [{"all_reduce": 1}, {"all_reduce": 12}]
        assert seen["dtensor"] == [{"all_reduce": 1}, {"all_reduce": 16}]
        # DDP's gradient reduction, from its reducer during backward: one bucket of 4 floats.
        assert seen["ddp"] == [{"all_reduce": 1}, {"all_reduce": 16}]


def test_a_wait_that_failed_is_retried_not_taken_for_a_disagreement() -> None:
    # Rank 0 reads its loss before rank 1 has ended the step: that wait fails at once. Once
    # rank 1 has ended it, the same read gives the step's loss, not a false disagreement.
    group = InProcessGroup(2)
    accs = [Accumulator(loss_reduction="sum", collective=group.collective(r)) for r in range(2)]
    for rank, acc in enumerate(accs):
        acc.begin(num_tokens=[rank + 1])
    results = []
    for acc in accs:
        acc.scale_loss(torch.tensor(3.0))
        results.append(acc.end())
        if len(results) == 1:
            with pytest.raises(RuntimeError, match=r"before rank\(s\) \[1\] started it"):
                results[0].loss  # noqa: B018
    assert [r.loss.item() for r in results] == [2.0, 2.0]  # 6 over 3 tokens


# Several loss terms: an LM loss per token and a router-style loss per sequence.


def _terms_of(model, x, y):
    logits = model(x)
    lm, _ = token_cross_entropy(logits, y, shift=True)
    aux = logits.softmax(-1).mean(1).pow(2).sum(-1).mean()  # a mean over sequences
    return {"lm": lm, "aux": aux}


def with_terms(model, microbatches, collective):
    terms = [Term("lm", "sum"), Term("aux", "mean", "samples")]
    acc = Accumulator(terms=terms, collective=collective)
    acc.begin(
        num_tokens=[count_tokens(y, shift=True) for _, y in microbatches],
        num_samples=[len(y) for _, y in microbatches],
    )
    for x, y in microbatches:
        acc.scale_loss(_terms_of(model, x, y)).backward()
    return acc.end()


def aux_per_microbatch(model, microbatches, collective):
    """The auxiliary loss scaled by 1 / num_microbatches (as Megatron scales it), the LM loss
    right; the logged losses are each term's, by name."""
    acc = Accumulator(loss_reduction="sum", collective=collective)
    acc.begin(num_tokens=[count_tokens(y, shift=True) for _, y in microbatches])
    aux_logged = 0.0
    for x, y in microbatches:
        terms = _terms_of(model, x, y)
        aux = torch.nan_to_num(terms["aux"]) / len(microbatches)
        (acc.scale_loss(terms["lm"]) + aux).backward()
        aux_logged += aux.item()
    result = acc.end()
    return {"loss": result.loss.item() + aux_logged, "lm": result.loss, "aux": aux_logged}


def test_a_loop_of_several_terms_passes_and_its_terms_are_checked() -> None:
    assert_split_invariant(with_terms, model(), examples(), collate, counts=counts(), rtol=1e-10)


def test_a_term_weighted_per_microbatch_fails_naming_the_logged_terms() -> None:
    with pytest.raises(AssertionError) as raised:
        assert_split_invariant(aux_per_microbatch, model(), examples(), collate, counts=counts())
    report = str(raised.value)
    assert "the gradient is off by" in report
    assert re.search(r"the ranks logged \{loss: [-\d.e]+, lm: [-\d.e]+, aux: [-\d.e]+\}", report)


# Context parallelism simulated: each data-parallel rank as 2 ranks that each hold half of the
# positions of every sequence (the model computes each position on its own, so a shard is exact).


def context_parallel_step(count_whole_sequences: bool = False) -> Any:
    def step(net: torch.nn.Module, microbatches: list, collective: Any, shard: Any) -> Any:
        acc = Accumulator(loss_reduction="sum", collective=collective)
        held = [
            (x[:, shard.positions(LENGTH)], y[:, shard.positions(LENGTH)]) for x, y in microbatches
        ]
        counted = microbatches if count_whole_sequences else held
        acc.begin(num_tokens=[count_tokens(y) for _, y in counted])
        for x, y in held:
            loss_sum, _ = token_cross_entropy(net(x), y)
            acc.scale_loss(loss_sum).backward()
        return acc.end()

    return step


def sequence_mean_step(whole_mask: bool) -> Any:
    """Each sequence's token mean, averaged over the sequences: with the whole mask and the
    positions, a sequence counts once; with the rank's shard of the mask, each shard is a
    sequence of its own."""

    def step(net: torch.nn.Module, microbatches: list, collective: Any, shard: Any) -> Any:
        acc = Accumulator(terms=[Term("loss", "sum", "weight_sum")], collective=collective)
        keep = shard.positions(LENGTH)
        acc.begin(parameters=net)
        for x, y in microbatches:
            per_token = F.cross_entropy(
                net(x[:, keep]).transpose(1, 2), y[:, keep].clamp(min=0), reduction="none"
            )
            mask = (y != IGNORE).long()
            if whole_mask:
                loss, share = aggregate(per_token, mask, mode="seq-mean-token-mean", positions=keep)
            else:
                loss, share = aggregate(per_token, mask[:, keep], mode="seq-mean-token-mean")
            acc.scale_loss(loss, weight_sum=share).backward()
        return acc.end()

    return step


@pytest.mark.parametrize("context_parallel", [1, 2, 3])
def test_a_context_parallel_loop_passes(context_parallel: int) -> None:
    assert_split_invariant(
        context_parallel_step(), model(), examples(), collate,
        counts=[max(n, 0) for n in LENGTHS], context_parallel=context_parallel, rtol=1e-10,
    )  # fmt: skip
    assert_split_invariant(
        sequence_mean_step(whole_mask=True), model(), examples(), collate,
        context_parallel=context_parallel, rtol=1e-10,
    )  # fmt: skip


def test_the_shards_are_contiguous_and_cover_the_sequence() -> None:
    for size in range(1, 6):
        for length in range(0, 12):
            pieces = [ContextShard(rank, size).positions(length) for rank in range(size)]
            covered = [i for piece in pieces for i in range(length)[piece]]
            assert covered == list(range(length))
            expected = [len(t) for t in torch.arange(length).tensor_split(size)]
            assert [len(range(length)[piece]) for piece in pieces] == expected


def test_counting_whole_sequences_on_each_context_parallel_rank_is_caught() -> None:
    with pytest.raises(AssertionError) as caught:
        assert_split_invariant(
            context_parallel_step(count_whole_sequences=True), model(), examples(), collate,
            counts=LENGTHS, context_parallel=2, rtol=1e-10,
        )  # fmt: skip
    assert "the gradient is 1/2 of the reference: each context-parallel rank counts" in str(
        caught.value
    )


def test_a_sequence_mean_over_each_shard_alone_is_caught() -> None:
    with pytest.raises(AssertionError) as caught:
        assert_split_invariant(
            sequence_mean_step(whole_mask=False), model(), examples(), collate,
            context_parallel=2, rtol=1e-10,
        )  # fmt: skip
    assert "the context-parallel ranks' shards do not add up to the whole sequences" in str(
        caught.value
    )


@pytest.mark.parametrize("value", [0, 2.0, True, "2"])
def test_a_bad_context_parallel_is_refused(value: object) -> None:
    with pytest.raises(ValueError, match=r"context_parallel="):
        assert_split_invariant(
            context_parallel_step(),
            model(),
            examples(),
            collate,
            context_parallel=value,  # type: ignore[arg-type]
        )


def test_a_naive_loop_under_context_parallelism_is_blamed_on_its_weighting() -> None:
    def naive(net: torch.nn.Module, microbatches: list, collective: Any, shard: Any) -> None:
        keep = shard.positions(LENGTH)
        for x, y in microbatches:
            loss = F.cross_entropy(
                net(x[:, keep]).flatten(0, 1), y[:, keep].flatten(), ignore_index=IGNORE
            )
            (torch.nan_to_num(loss) / len(microbatches)).backward()

    with pytest.raises(AssertionError) as caught:
        assert_split_invariant(naive, model(), examples(), collate, context_parallel=2)
    report = str(caught.value)
    assert "so with each rank holding whole sequences too" in report
    assert "shards do not add up" not in report


@pytest.mark.parametrize(("rank", "size"), [(0, 0), (2, 2), (-1, 2)])
def test_a_shard_out_of_range_is_refused(rank: int, size: int) -> None:
    with pytest.raises(ValueError, match="a rank from 0 to size - 1"):
        ContextShard(rank, size)
