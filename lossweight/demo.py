"""Watch the gradient-accumulation bug happen, and lossweight fix it: ``python -m lossweight.demo``.

A tiny causal language model, built here with no download, trains on synthetic sequences of
very different lengths (most are short, a few fill the context; the rest is padding). The same
global batches are split four ways: one microbatch (the reference), 8 microbatches on one rank,
8 ranks of one microbatch each (simulated in this process, grouped by length so that their
token counts differ a lot), and 2 real gloo processes of 4 microbatches each. Each split trains
twice: with the usual ``loss / accumulation_steps`` (each microbatch's mean loss weighs the
same), and with lossweight's token weighting. The first changes the gradient with the split;
the second gives the reference gradient to float round-off.

Needs the ``demo`` extra (rich for the progress and the table, matplotlib for the plot).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import math
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from . import Accumulator, count_tokens, token_cross_entropy
from .testing import InProcessGroup

VOCABULARY = 32
CONTEXT = 64
BATCH = 16  # sequences per optimizer step
IGNORE = -100

# Sequences per microbatch, per rank. "8 x 1" holds the same rows as the others, sorted by
# length first, so that its ranks hold very different numbers of tokens.
SPLITS: dict[str, list[list[int]]] = {
    "1 x 1": [[16]],
    "1 x 8": [[2] * 8],
    "8 x 1": [[2]] * 8,
    "2 x 4 (gloo)": [[1, 3, 2, 2], [4, 2, 1, 1]],
}
METHODS = ("naive", "lossweight")
GLOO_SPLIT = "2 x 4 (gloo)"
Progress = Callable[[str, str], None]  # called with (split, method) after each step


class TinyLM(nn.Module):
    """One pre-norm transformer block with causal attention: small, but a real causal LM."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCABULARY, width)
        self.position = nn.Embedding(CONTEXT, width)
        self.norm1 = nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, num_heads=2, batch_first=True)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )
        self.head = nn.Linear(width, VOCABULARY)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        x = self.embed(tokens) + self.position(torch.arange(length))
        causal = torch.ones(length, length, dtype=torch.bool).triu(1)  # True: may not attend
        h = self.norm1(x)
        x = x + self.attention(h, h, h, attn_mask=causal, need_weights=False)[0]
        logits: torch.Tensor = self.head(x + self.mlp(self.norm2(x)))
        return logits


def make_batches(seed: int, steps: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``steps`` training batches and one held-out batch of right-padded sequences.

    Short and long sequences come from two different Markov chains, so a method that
    overweights the tokens of short sequences learns a different model.
    """
    generator = torch.Generator().manual_seed(seed)
    chains = [
        torch.softmax(4 * torch.randn(VOCABULARY, VOCABULARY, generator=generator), dim=-1)
        for _ in range(2)
    ]

    def batch(rows: int) -> torch.Tensor:
        # Lengths spread over two orders of magnitude: log-uniform between 2 and CONTEXT.
        lengths = torch.exp(torch.rand(rows, generator=generator) * math.log(CONTEXT / 2))
        lengths = (2 * lengths).long().clamp(2, CONTEXT)
        tokens = torch.full((rows, CONTEXT), IGNORE, dtype=torch.int64)
        for row, length in enumerate(lengths.tolist()):
            chain = chains[int(length > 16)]
            token = int(torch.randint(VOCABULARY, (), generator=generator))
            for position in range(length):
                tokens[row, position] = token
                token = int(torch.multinomial(chain[token], 1, generator=generator))
        return tokens

    return [batch(BATCH) for _ in range(steps)], batch(64)


def inputs_and_labels(sequences: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (padding replaced by 0) and labels (-100 on the padding)."""
    return sequences.clamp(min=0), sequences


def microbatches(batch: torch.Tensor, split: str) -> list[list[torch.Tensor]]:
    """The rows of each microbatch of each rank of ``split``."""
    if split == "8 x 1":
        batch = batch[(batch != IGNORE).sum(dim=1).argsort(stable=True)]
    ranks: list[list[torch.Tensor]] = []
    start = 0
    for sizes in SPLITS[split]:
        ranks.append([])
        for size in sizes:
            ranks[-1].append(batch[start : start + size])
            start += size
    return ranks


def step_loss(model: nn.Module, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the summed next-token loss of ``rows``, its number of target tokens)."""
    tokens, labels = inputs_and_labels(rows)
    return token_cross_entropy(model(tokens), labels, shift=True)


def backward_microbatches(
    model: nn.Module, shard: list[torch.Tensor], method: str, acc: Accumulator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run one rank's microbatches of a step; return its detached loss sum and token count.

    The accumulator's step must be open when the method is lossweight.
    """
    loss_sum, tokens = torch.zeros(()), torch.zeros((), dtype=torch.int64)
    for index, rows in enumerate(shard):
        last = index == len(shard) - 1
        # DDP skips its gradient all-reduce on all but the last microbatch of a step.
        skip_sync = isinstance(model, DistributedDataParallel) and not last
        with model.no_sync() if skip_sync else contextlib.nullcontext():  # type: ignore[operator]
            summed, count = step_loss(model, rows)
            # Naive: the microbatch's mean, divided by the accumulation steps.
            loss = summed / count / len(shard) if method == "naive" else acc.scale_loss(summed)
            loss.backward()  # type: ignore[no-untyped-call]
        loss_sum, tokens = loss_sum + summed.detach(), tokens + count
    return loss_sum, tokens


def token_mean(model: nn.Module, rows: torch.Tensor) -> float:
    with torch.no_grad():
        summed, count = step_loss(model, rows)
    return float(summed / count)


def begin(acc: Accumulator, shard: list[torch.Tensor]) -> None:
    acc.begin(num_tokens=[count_tokens(rows, shift=True) for rows in shard])


@dataclass
class Run:
    """One split trained with one method."""

    split: str
    method: str
    losses: list[float] = field(default_factory=list)  # token-mean loss of each step's batch
    first_gradients: list[torch.Tensor] = field(default_factory=list)
    eval_loss: float = math.nan
    gradient_difference: float = math.nan  # to the reference, after the first step


def train_in_process(
    split: str,
    method: str,
    batches: list[torch.Tensor],
    held_out: torch.Tensor,
    seed: int,
    advance: Progress,
) -> Run:
    """Train on ranks simulated in this process; their gradients are averaged as DDP does."""
    torch.manual_seed(seed)
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    world_size = len(SPLITS[split])
    # Driven one rank after the other from this thread: every rank starts a reduction (in
    # begin() and end()) before any rank waits for it.
    group = InProcessGroup(world_size)
    accs = [
        Accumulator(weight_by="tokens", loss_reduction="sum", collective=group.collective(rank))
        for rank in range(world_size)
    ]
    run = Run(split, method)
    for batch in batches:
        shards = microbatches(batch, split)
        if method == "lossweight":
            for acc, shard in zip(accs, shards, strict=True):
                begin(acc, shard)
        loss_sum, tokens = torch.zeros(()), torch.zeros((), dtype=torch.int64)
        for acc, shard in zip(accs, shards, strict=True):
            rank_sum, rank_tokens = backward_microbatches(model, shard, method, acc)
            loss_sum, tokens = loss_sum + rank_sum, tokens + rank_tokens
            if method == "lossweight":
                acc.end()
        for parameter in model.parameters():  # the average over ranks that DDP would take
            assert parameter.grad is not None
            parameter.grad /= world_size
        finish_step(run, model, optimizer, float(loss_sum / tokens))
        advance(split, method)
    run.eval_loss = token_mean(model, held_out)
    return run


def finish_step(run: Run, model: nn.Module, optimizer: torch.optim.Optimizer, loss: float) -> None:
    if not run.first_gradients:
        run.first_gradients = [p.grad.detach().clone() for p in model.parameters()]  # type: ignore[union-attr]
    run.losses.append(loss)
    optimizer.step()
    optimizer.zero_grad()


def gloo_worker(
    rank: int, world_size: int, scratch: str, seed: int, steps: int, messages: mp.SimpleQueue[str]
) -> None:
    """One real data-parallel rank: DDP over gloo, ``no_sync`` on all but the last microbatch.

    Rank 0 reports each step on ``messages`` and saves each finished run in ``scratch``.
    """
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{scratch}/init", rank=rank, world_size=world_size
    )
    batches, held_out = make_batches(seed, steps)
    for method in METHODS:
        torch.manual_seed(seed)
        model = DistributedDataParallel(TinyLM())
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        acc = Accumulator(weight_by="tokens", loss_reduction="sum")
        run = Run(GLOO_SPLIT, method)

        for batch in batches:
            shard = microbatches(batch, GLOO_SPLIT)[rank]
            if method == "lossweight":
                begin(acc, shard)
            loss_sum, tokens = backward_microbatches(model, shard, method, acc)
            if method == "lossweight":
                acc.end()
            totals = torch.stack([loss_sum.double(), tokens.double()])
            dist.all_reduce(totals)  # the true token-mean loss, for the table and the plot
            finish_step(run, model, optimizer, float(totals[0] / totals[1]))
            if rank == 0:
                messages.put(method)
        run.eval_loss = token_mean(model.module, held_out)
        if rank == 0:
            torch.save(run, Path(scratch, f"{method}.pt"))
    dist.destroy_process_group()


def train_gloo(seed: int, steps: int, advance: Progress) -> list[Run]:
    """Spawn the 2 gloo ranks and relay their progress while they train."""
    messages = mp.get_context("spawn").SimpleQueue()
    with tempfile.TemporaryDirectory() as scratch:
        processes = mp.start_processes(  # type: ignore[attr-defined,no-untyped-call]
            gloo_worker,
            args=(2, scratch, seed, steps, messages),
            nprocs=2,
            join=False,
            start_method="spawn",
        )
        finished = False
        while not finished:
            finished = processes.join(timeout=0.05)
            while not messages.empty():
                advance(GLOO_SPLIT, messages.get())
        return [torch.load(Path(scratch, f"{method}.pt"), weights_only=False) for method in METHODS]


def max_relative_difference(actual: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    scale = max(float(r.abs().max()) for r in reference)
    return max(float((a - r).abs().max()) for a, r in zip(actual, reference, strict=True)) / scale


def run_demo(steps: int, seed: int, progress: Progress | None = None) -> list[Run]:
    """Train every split with every method on the same batches; return the runs.

    The in-process runs are tiny: one thread is fastest for them, and stays fast on a machine
    whose other cores are busy (several threads would wait for one another there). The
    caller's thread count is restored afterwards.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run_demo(steps, seed, progress)
    finally:
        torch.set_num_threads(threads)


def _run_demo(steps: int, seed: int, progress: Progress | None) -> list[Run]:
    batches, held_out = make_batches(seed, steps)
    advance: Progress = progress or (lambda split, method: None)
    runs = []
    for split in SPLITS:
        if split == GLOO_SPLIT:
            runs += train_gloo(seed, steps, advance)
            continue
        for method in METHODS:
            runs.append(train_in_process(split, method, batches, held_out, seed, advance))
    reference = next(r for r in runs if r.split == "1 x 1" and r.method == "lossweight")
    for run in runs:
        run.gradient_difference = max_relative_difference(
            run.first_gradients, reference.first_gradients
        )
    return runs


def plot(runs: Sequence[Run], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    colors = dict(zip(SPLITS, ("black", "tab:blue", "tab:orange", "tab:green"), strict=True))
    # Curves that coincide (lossweight's) stay visible: each split has its own dash pattern
    # and marker, drawn with a thinner line than the one below it.
    styles = dict(zip(SPLITS, ("-", "--", "-.", ":"), strict=True))
    markers = dict(zip(SPLITS, ("o", "s", "^", "x"), strict=True))
    for axis, method in zip(axes, METHODS, strict=True):
        for order, run in enumerate(r for r in runs if r.method == method):
            axis.plot(
                run.losses,
                color=colors[run.split],
                linestyle=styles[run.split],
                marker=markers[run.split],
                markevery=max(1, len(run.losses) // 8) + order,
                linewidth=2.4 - 0.5 * order,
                label=run.split,
                alpha=0.9,
            )
        title = "loss / accumulation_steps" if method == "naive" else "lossweight (tokens)"
        axis.set_title(title)
        axis.set_xlabel("optimizer step")
        axis.grid(alpha=0.3)
    axes[0].set_ylabel("token-mean training loss")
    axes[1].legend(title="ranks x microbatches")
    figure.suptitle("Same batches, different splits: naive weighting fans out, lossweight does not")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m lossweight.demo", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps (default 40)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data and the model")
    parser.add_argument(
        "--output",
        type=Path,
        default=Path("lossweight-demo.png"),
        help="where to write the plot (default ./lossweight-demo.png)",
    )
    parser.add_argument("--no-plot", action="store_true", help="skip the plot")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps {args.steps}: train at least 1 step")
    missing = [name for name in _needed(plotting=not args.no_plot) if not _installed(name)]
    if missing:
        parser.exit(
            2,
            f"the demo needs {' and '.join(missing)}, which "
            f"{'is' if len(missing) == 1 else 'are'} not installed: "
            'pip install "lossweight[demo]"'
            + ("" if "rich" in missing else ", or run it with --no-plot")
            + "\n",
        )

    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    console = Console()
    console.print(
        "Each split trains twice on the same batches of sequences of very different lengths: "
        "naive = loss / accumulation_steps (every microbatch's mean weighs the same, and the "
        "ranks are averaged), lossweight = each microbatch weighted by its target tokens."
    )
    with Progress(console=console, transient=True) as bar:
        tasks = {
            (split, method): bar.add_task(f"{split:>13}  {method}", total=args.steps)
            for split in SPLITS
            for method in METHODS
        }
        runs = run_demo(
            args.steps, args.seed, lambda split, method: bar.advance(tasks[(split, method)])
        )

    table = Table(title=f"{args.steps} steps of a tiny causal LM, {BATCH} sequences a step")
    table.add_column("ranks x microbatches")
    table.add_column("weighting")
    table.add_column("gradient vs 1 x 1, step 1", justify="right")
    table.add_column(f"held-out loss after {args.steps} steps", justify="right")
    for run in sorted(runs, key=lambda r: (METHODS.index(r.method), list(SPLITS).index(r.split))):
        table.add_row(
            run.split, run.method, f"{run.gradient_difference:.1e}", f"{run.eval_loss:.4f}"
        )
    console.print(table)
    console.print(
        "The gradient column is the largest difference to the 1 x 1 gradient, relative to its "
        "largest entry. lossweight's splits agree to float round-off; the naive ones do not."
    )
    if not args.no_plot:
        plot(runs, args.output)
        console.print(f"Plot written to {args.output.resolve()}")


def _needed(plotting: bool) -> list[str]:
    return ["rich", "matplotlib"] if plotting else ["rich"]


def _installed(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


if __name__ == "__main__":
    main()
