"""Tools to test weighting code, one's own training loop included.

- :class:`InProcessGroup`: data-parallel ranks simulated in one process, each with a real
  :class:`lossweight.Collective`, to run a loop's ranks in threads.
- :func:`assert_split_invariant`: runs a training step on its whole batch and on splits of it
  into microbatches and ranks that break naive weighting, and reports any difference in the
  gradient or the logged loss, with its likely cause.
- :func:`count_collectives`: counts the torch.distributed collectives a block issues (DDP's
  and FSDP's included), to assert what a step costs in communication.
- :mod:`lossweight.testing.strategies`: hypothesis strategies (splits, counts, padded labels);
  the only module that imports hypothesis (``pip install "/path/to/lossweight[testing]"``).

This package is not imported by ``import lossweight``.
"""

from ..errors import add_messages
from ._checker import ContextShard, Split, assert_split_invariant, default_splits
from ._collectives import CollectiveCounts, count_collectives
from ._group import InProcessCollective, InProcessGroup

# The rows of this package's errors (the split checker's and the simulated ranks'), added to
# lossweight.errors.MESSAGES when it is imported, before any of its modules can raise.
# fmt: off
_MESSAGES: dict[str, tuple[type[Exception], str]] = {
    "context_shard": (ValueError, "ContextShard(rank={rank!r}, size={size!r}): pass a size of 1 or more and a rank from 0 to size - 1"),
    "simulated_world_size": (ValueError, "world_size={value!r}; pass a positive int, or None"),
    "too_few_counts": (ValueError, "counts has {count} entries; the default splits of {worlds} need at least {needed} examples, one count each"),
    "counts_per_example": (ValueError, "counts has {counts} entries but examples has {examples}; give one count per example"),
    "example_count_negative": (ValueError, "counts[{index}]={value!r} is negative; give each example's number of items its loss covers (0 or more)"),
    "too_few_examples": (ValueError, "len(examples) is {count}; the default splits of {worlds} need at least {needed} examples: give {needed} or more (a smaller batch leaves some splits unbuilt, and with 1 example no split differs from another)"),
    "one_example": (ValueError, "len(examples) is {count}; splits of fewer than 2 examples cannot weigh one example against another, so nothing could differ: give at least 2 examples"),
    "no_splits": (ValueError, "splits is empty, so the check would compare nothing: give at least one Split, or leave splits out for the default ones"),
    "only_the_reference": (ValueError, "every split in splits is the whole batch in one microbatch on one rank, as the reference is, so the check would compare nothing: give a split of several microbatches or ranks"),
    "not_a_split": (ValueError, "splits[{index}] is a {kind}, not a Split; make one with Split.of(name, ranks)"),
    "split_examples": (ValueError, "splits[{index}] ({name!r}) must hold each of examples 0 to {last} once: it {wrong}"),
    "split_ranks": (ValueError, "splits[{index}] ({name!r}) has {worlds}, but torch.distributed runs {world_size} processes, which are the ranks of every split: give splits of {world_size} ranks, or leave splits out for default_splits(counts, world_size={world_size})"),
    "bad_rtol": (ValueError, "rtol={value!r}; pass a finite number of 0 or more (1e-5 suits float32, 1e-10 float64)"),
    "batch_norm": (ValueError, "model has batch norm in train mode, in {modules}: it normalizes each microbatch by that microbatch's statistics, so the gradient depends on the split whatever the weighting; call .eval() on those modules for the check"),
    "nothing_trainable": (ValueError, "model has no parameter that requires a gradient, so the check would compare nothing: pass the model the step trains"),
    "context_parallel_type": (ValueError, "context_parallel={value!r}; pass the number of context-parallel ranks to simulate per data-parallel rank, an int of 1 or more, or None"),
    "context_parallel_size": (ValueError, "context_parallel={value}; pass an int of 1 or more (1: each rank holds whole sequences, and the step still gets its shard), or None"),
    "context_parallel_processes": (ValueError, "context_parallel={value} simulates ranks in one process, but torch.distributed runs {world_size} processes: run the check in one process"),
    "checks_differ": (ValueError, "rank {rank} called assert_split_invariant with other {differ} than rank {own} (as many examples, with the same counts and splits, must run on every process): every process passes the same arguments"),
    "reference_not_finite": (AssertionError, "the step's gradient of the whole batch in one microbatch holds NaN or inf, so no split can be compared to it: fix the loss of the whole batch first"),
    "reference_no_gradient": (AssertionError, "the step left no gradient on the model it was given (the .grad of every parameter that requires one is None or 0 after the whole batch), so the check would compare nothing: it trains another model than its first argument (a module-level one, say), or its loss does not reach the parameters (detached, or computed under torch.no_grad())"),
    "not_deterministic": (AssertionError, "the step is not deterministic: two runs of the whole batch in one microbatch, from the same weights, differ: {difference}. Randomness drawn in train mode (dropout called as a function, noise, sampling) differs with the microbatch's shape, so every split would differ whatever its weighting; turn it off for the check, or put the modules that draw it in eval mode{known}"),
    "model_changed": (AssertionError, "the step changed the model passed to assert_split_invariant ({what} differs after a run), though every run gets a copy of it: it trains that model directly (a module-level one, or one its closure holds), so each run would start from the weights the previous one left; train the model the step is given as its first argument"),
    "split_dependent": (AssertionError, "the step depends on how its {examples} examples are split: {differing} of {splits} splits differ from one microbatch on one rank{loss}:\n{problems}{random}"),
    "bad_rank": (ValueError, "rank={value!r}; pass a rank from 0 to {last}"),
    "run_reentered": (RuntimeError, "InProcessGroup.run() is already running: it is not reentrant; call it from outside the work it runs, or use another InProcessGroup"),
    "unlike_contributions": (RuntimeError, "all-reduce {index}: rank {rank} contributes a {dtype} tensor of shape {shape}, rank {other} a {other_dtype} tensor of shape {other_shape}; every rank must reduce tensors of the same shape and dtype in the same order, as a real process group requires"),
    "reduce_abandoned": (RuntimeError, "all-reduce {index} of rank {rank} was abandoned when a run of this group failed before every rank started it; its result will never come"),
    "waited_before_started": (RuntimeError, "rank {rank} waited for all-reduce {index} before rank(s) {missing} started it: driven from one thread, every rank must start an all-reduce before any rank waits for it (run a call that waits for its own all-reduce on every rank at once with InProcessGroup.run())"),
    "rank_failed": (RuntimeError, "all-reduce {index} of rank {rank} abandoned: another rank failed"),
    "reduce_deadlocked": (RuntimeError, "all-reduce {index} of rank {rank} can never complete: every rank still running waits, and rank(s) {missing} did not start it (the ranks issued their collectives in different numbers or orders, where a real process group would hang; issued so far: {issued})"),
    "reduce_timed_out": (RuntimeError, "all-reduce {index} of rank {rank} never completed: rank(s) {missing} did not start it within {timeout:g} s (the ranks issued their collectives in different numbers or orders, where a real process group would hang; issued so far: {issued})"),
}
# fmt: on
add_messages(_MESSAGES)

__all__ = [
    "CollectiveCounts",
    "ContextShard",
    "InProcessCollective",
    "InProcessGroup",
    "Split",
    "assert_split_invariant",
    "count_collectives",
    "default_splits",
]
