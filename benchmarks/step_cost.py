"""What loss weighting costs per optimizer step, measured in one run.

lossweight beside a plain loop and other trainers' patterns, with the variants interleaved:

    .venv/bin/python benchmarks/step_cost.py              # 1 and 2 ranks (NCCL on a GPU)
    .venv/bin/python benchmarks/step_cost.py --steps 10   # a quick look
    .venv/bin/python benchmarks/step_cost.py --micro      # only the per-call overhead
    .venv/bin/python benchmarks/step_cost.py --json benchmarks/results.json   # save the record

Every variant trains its own copy of the same small GPT-style model on the same padded batches,
under DDP, with the same optimizer. For each step index the variants run one after the other,
in an order that rotates from step to step, so that slow phases of a noisy machine hit them
all alike. Reported per variant:

- the median step time, its 25th-75th percentile spread, and the median of its step-by-step
  ratio to the baseline step of the same index;
- the collectives it issues per step, counted by wrapping torch.distributed's functions
  (which still run), and the bytes each rank contributes to them;
- the host syncs per step of its weighting and logging code: on the CPU by counting the
  Tensor methods that read a value back (``item``, ``tolist``, ``__bool__``, ``__float__``,
  ``__int__``, ``__index__``); on a GPU also by ``torch.cuda.set_sync_debug_mode``.

The variants re-create other trainers' per-step patterns from their documented math (the
collectives, syncs and gradient passes listed in the project's notes), not their code:

- ``baseline``: ``loss / accumulation_steps`` (wrong weighting; the cost floor), and the same
  again as an A/A control, whose ratio to the baseline is the noise of the measurement;
- ``lossweight count-first``: ``Accumulator`` with ``loss_logging="next_step"`` (the loss
  of each step rides on the next step's count reduction);
- ``lossweight count-first, loss in end()``: the default ``loss_logging="end"`` (one more
  all-reduce, started by ``end()``, so the loss is ready when the step ends);
- ``lossweight scale-after``: ``Accumulator`` with counts given per microbatch;
- ``HF Trainer pattern``: an all-gather of the counts, an isnan check per microbatch, and an
  all-gather of the rank losses to log their mean;
- ``Composer pattern``: an all-reduce of the count read with ``.item()``, then one all-reduce
  and one ``.item()`` per loss key (one key here);
- ``torchtune pattern``: backward of ``loss_sum``, an all-reduce of the count and one of the
  loss, a foreach pass scaling the gradients, and ``.item()`` to log.

Every variant produces the step's logged loss every step, since that is what a trainer does.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import platform
import statistics
import tempfile
import time
import timeit
import warnings
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import lossweight
from lossweight import Accumulator, count_tokens, token_cross_entropy

IGNORE = -100
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "broadcast",
    "reduce_scatter_tensor",
    "reduce",
    "gather",
    "barrier",
)
HOST_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__")


class GPT(nn.Module):
    """A small GPT-style decoder: token and position embeddings, causal pre-norm blocks."""

    def __init__(self, vocabulary: int, context: int, width: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocabulary, width)
        self.position = nn.Embedding(context, width)
        block = nn.TransformerEncoderLayer(
            width,
            nhead=4,
            dim_feedforward=4 * width,
            dropout=0.0,
            batch_first=True,
            norm_first=True,
        )
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocabulary)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        x = self.embed(tokens) + self.position(torch.arange(length, device=tokens.device))
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=tokens.device)
        return self.head(self.blocks(x, mask=mask, is_causal=True))


class Meter:
    """Counts collectives, their bytes and host reads, per variant, inside ``window(name)``."""

    def __init__(self) -> None:
        self.collectives: dict[str, Counter[str]] = defaultdict(Counter)
        self.bytes: Counter[str] = Counter()
        self.host_reads: Counter[str] = Counter()
        self.device_syncs: Counter[str] = Counter()
        self.active: str | None = None

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Wrap the collectives and the host reads; each wrapped call still runs."""
        originals = {name: getattr(dist, name) for name in COLLECTIVES}
        tensor_originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}
        for name in COLLECTIVES:
            setattr(dist, name, self._counted_collective(name, originals[name]))
        for name in HOST_READS:
            setattr(torch.Tensor, name, self._counted_read(tensor_originals[name]))
        try:
            yield
        finally:
            for name, original in originals.items():
                setattr(dist, name, original)
            for name, original in tensor_originals.items():
                setattr(torch.Tensor, name, original)

    def _counted_collective(self, name: str, original: Callable) -> Callable:
        @functools.wraps(original)
        def call(*args, **kwargs):
            if self.active is not None:
                self.collectives[self.active][name] += 1
                tensor = args[1] if name == "all_gather_into_tensor" else (args or [None])[0]
                if isinstance(tensor, torch.Tensor):
                    self.bytes[self.active] += tensor.numel() * tensor.element_size()
            return original(*args, **kwargs)

        return call

    def _counted_read(self, original: Callable) -> Callable:
        def call(tensor, *args):
            if self.active is not None:
                self.host_reads[self.active] += 1
            return original(tensor, *args)

        return call

    @contextlib.contextmanager
    def window(self, name: str) -> Iterator[None]:
        """Count what runs inside for ``name``; on a GPU, also the syncs CUDA reports."""
        cuda = torch.cuda.is_available()
        self.active = name
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if cuda:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                yield
            finally:
                if cuda:
                    torch.cuda.set_sync_debug_mode("default")
                self.active = None
        self.device_syncs[name] += sum("synchroniz" in str(w.message) for w in caught)


def token_mean_loss(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return F.cross_entropy(
        logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=IGNORE
    )


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
    CountFirstLossInEnd,
    ScaleAfter,
    HFTrainerPattern,
    ComposerPattern,
    TorchtunePattern,
]


def make_microbatches(
    args: argparse.Namespace, rank: int, step: int, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A rank's microbatches for one step: right-padded rows of random lengths."""
    generator = torch.Generator().manual_seed(args.seed * 100_003 + step * 101 + rank)
    microbatches = []
    for _ in range(args.microbatches):
        tokens = torch.randint(0, args.vocabulary, (args.rows, args.context), generator=generator)
        lengths = torch.randint(2, args.context + 1, (args.rows, 1), generator=generator)
        labels = tokens.masked_fill(torch.arange(args.context) >= lengths, IGNORE)
        microbatches.append((tokens.to(device), labels.to(device)))
    return microbatches


def measure(rank: int, world_size: int, scratch: str, args: argparse.Namespace) -> None:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, args.threads // world_size))
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"file://{scratch}/init",
        rank=rank,
        world_size=world_size,
    )
    torch.manual_seed(args.seed)
    base = GPT(args.vocabulary, args.context, args.width, args.layers).to(device)
    variants = []
    for variant in VARIANTS:
        model = GPT(args.vocabulary, args.context, args.width, args.layers).to(device)
        model.load_state_dict(base.state_dict())
        variants.append(variant(DistributedDataParallel(model)))
    meter = Meter()
    times: dict[str, list[float]] = {v.name: [] for v in variants}
    with meter.installed():  # for the whole run, so that every variant pays the wrappers alike
        run_steps(args, rank, device, variants, meter, times)
    if rank == 0:
        results = {}
        baseline = times[variants[0].name]
        for variant in variants:
            name = variant.name
            t = times[name]
            quartiles = statistics.quantiles(t, n=4)
            ratios = [a / b for a, b in zip(t, baseline, strict=True)]
            ratio_quartiles = statistics.quantiles(ratios, n=4)
            results[name] = {
                "median_ms": 1e3 * statistics.median(t),
                "p25_ms": 1e3 * quartiles[0],
                "p75_ms": 1e3 * quartiles[2],
                "ratio_to_baseline": statistics.median(ratios),
                "ratio_p25": ratio_quartiles[0],
                "ratio_p75": ratio_quartiles[2],
                "collectives_per_step": {
                    k: v / args.steps for k, v in meter.collectives[name].items()
                },
                "bytes_per_step": meter.bytes[name] / args.steps,
                "host_reads_per_step": meter.host_reads[name] / args.steps,
                "device_syncs_per_step": meter.device_syncs[name] / args.steps if cuda else None,
            }
        Path(scratch, "results.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def run_steps(
    args: argparse.Namespace,
    rank: int,
    device: torch.device,
    variants: list[Variant],
    meter: Meter,
    times: dict[str, list[float]],
) -> None:
    cuda = device.type == "cuda"
    for step in range(args.warmup + args.steps):
        microbatches = make_microbatches(args, rank, step, device)
        order = variants[step % len(variants) :] + variants[: step % len(variants)]
        for variant in order:
            dist.barrier()
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            with meter.window(variant.name) if step >= args.warmup else contextlib.nullcontext():
                variant.step(microbatches)
            variant.optimizer.step()
            variant.optimizer.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            if step >= args.warmup:
                times[variant.name].append(elapsed)


def run_ranks(world_size: int, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        mp.spawn(measure, args=(world_size, scratch, args), nprocs=world_size)
        return json.loads(Path(scratch, "results.json").read_text())


def call_overhead(args: argparse.Namespace, calls: int = 20_000, repeats: int = 5) -> dict:
    """Microseconds per call of the per-microbatch methods, beside the division they replace,
    and the library's own time for a whole step of ``args.microbatches`` microbatches (one
    process: the all-reduce is a no-op), with scale-after's gradient pass over the model."""
    loss = torch.tensor(2.5, requires_grad=True)
    count_first = Accumulator(loss_reduction="sum")
    count_first.begin(num_tokens=[7] * (calls * repeats + 1))
    count_first.scale_loss(loss)  # waits for the (single-process) reduction once
    scale_after = Accumulator(loss_reduction="sum")
    scale_after.begin(parameters=[loss])
    count = torch.tensor(7)

    def best(statement: Callable[[], object], number: int = calls) -> float:
        return 1e6 * min(timeit.repeat(statement, number=number, repeat=repeats)) / number

    per_call = {
        "loss / k (baseline)": best(lambda: loss / 4),
        "scale_loss(loss), count first": best(lambda: count_first.scale_loss(loss)),
        "backward_scale(0), count first": best(lambda: count_first.backward_scale(0)),
        "scale_loss(loss, num_tokens=tensor), scale after": best(
            lambda: scale_after.scale_loss(loss, num_tokens=count)
        ),
        "scale_loss(loss, num_tokens=int), scale after": best(
            lambda: scale_after.scale_loss(loss, num_tokens=7)
        ),
    }
    model = GPT(args.vocabulary, args.context, args.width, args.layers)
    parameters = list(model.parameters())
    grads = [torch.ones_like(parameter) for parameter in parameters]
    counts = [torch.tensor(7)] * args.microbatches
    accs = {
        logging: Accumulator(loss_reduction="sum", loss_logging=logging)
        for logging in ("end", "next_step")
    }

    def count_first_step(acc: Accumulator) -> None:
        acc.begin(num_tokens=counts)
        for _ in counts:
            acc.scale_loss(loss)
        acc.end()

    def give_gradients() -> None:
        # What the step's backward passes would do: before begin() the gradients are None
        # (zero_grad(set_to_none=True)); afterwards they exist, for end() to rescale.
        for parameter, grad in zip(parameters, grads, strict=True):
            parameter.grad = grad

    def take_gradients() -> None:
        for parameter in parameters:
            parameter.grad = None

    def scale_after_step() -> None:
        take_gradients()
        accs["end"].begin(parameters=parameters)
        give_gradients()
        for c in counts:
            accs["end"].scale_loss(loss, num_tokens=c)
        accs["end"].end()

    def harness() -> None:
        take_gradients()
        give_gradients()

    per_step = {
        "count first, loss_logging='next_step'": best(
            lambda: count_first_step(accs["next_step"]), number=500
        ),
        "count first, loss_logging='end'": best(lambda: count_first_step(accs["end"]), number=500),
        "scale after": best(scale_after_step, number=500) - best(harness, number=500),
    }
    return {"per_call_us": per_call, "per_step_us": per_step}


def markdown(results: dict[int, dict], overhead: dict) -> str:
    lines = []
    for world_size, variants in results.items():
        lines += [
            f"**{world_size} rank{'s' if world_size > 1 else ''}**",
            "",
            "| variant | median step (ms) | p25-p75 (ms) | ratio to baseline (p25-p75) "
            "| collectives / step | bytes / step | host syncs / step |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, r in variants.items():
            collectives = (
                ", ".join(f"{v:g} {k}" for k, v in sorted(r["collectives_per_step"].items())) or "0"
            )
            syncs = f"{r['host_reads_per_step']:g}"
            if r["device_syncs_per_step"] is not None:
                syncs += f" ({r['device_syncs_per_step']:g} by CUDA)"
            lines.append(
                f"| {name} | {r['median_ms']:.1f} | {r['p25_ms']:.1f}-{r['p75_ms']:.1f} "
                f"| {r['ratio_to_baseline']:.3f} ({r['ratio_p25']:.3f}-{r['ratio_p75']:.3f}) "
                f"| {collectives} | {r['bytes_per_step']:g} | {syncs} |"
            )
        lines.append("")
    lines += ["| per-microbatch call | µs per call |", "|---|---|"]
    lines += [f"| `{name}` | {us:.1f} |" for name, us in overhead["per_call_us"].items()]
    lines += ["", "| lossweight's own work per step (1 process) | µs per step |", "|---|---|"]
    lines += [f"| {mode} | {us:.0f} |" for mode, us in overhead["per_step_us"].items()]
    lines.append("")
    return "\n".join(lines)


def targets(results: dict[int, dict], overhead: dict) -> list[str]:
    """The targets the numbers are read against (reported, not asserted).

    The step-time ratio of a variant is only as precise as the A/A control's spread; the
    library's own time per step, over the baseline's median step, is the precise figure.
    """
    report = []
    # Each variant's own-work figure, and the collectives per step its design calls for.
    modes = {
        "lossweight count-first": ("count first, loss_logging='next_step'", 1),
        "lossweight count-first, loss in end()": ("count first, loss_logging='end'", 2),
        "lossweight scale-after": ("scale after", 1),
    }
    for world_size, variants in results.items():
        baseline_us = 1e3 * variants["baseline: loss / k"]["median_ms"]
        control = variants["baseline again (A/A control)"]
        noise = max(1 - control["ratio_p25"], control["ratio_p75"] - 1)
        for name, (mode, target) in modes.items():
            r = variants[name]
            collectives = sum(r["collectives_per_step"].values())
            own = overhead["per_step_us"][mode] / baseline_us
            report.append(
                f"{world_size} rank(s), {name}: own work {100 * own:.2f}% of the baseline step "
                f"(target <= 1%: {'met' if own <= 0.01 else 'not met'}); measured ratio "
                f"{r['ratio_to_baseline']:.3f}, A/A control {control['ratio_to_baseline']:.3f} "
                f"+- {noise:.3f}; {collectives:g} collective(s)/step (target {target}: "
                f"{'met' if collectives == target else 'not met'}); "
                f"{r['host_reads_per_step']:g} host syncs/step (target 0: "
                f"{'met' if r['host_reads_per_step'] == 0 else 'not met'})"
            )
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=40, help="measured steps per variant")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--rows", type=int, default=8, help="sequences per microbatch")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--vocabulary", type=int, default=512)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--micro", action="store_true", help="only the per-call overhead")
    parser.add_argument(
        "--json",
        type=Path,
        default=None,
        help="also write the record as JSON to this path (benchmarks/results.json is the "
        "committed one); by default nothing is written",
    )
    args = parser.parse_args()

    overhead = call_overhead(args)
    results = {} if args.micro else {n: run_ranks(n, args) for n in args.ranks}
    device = (
        torch.cuda.get_device_name()
        if torch.cuda.is_available()
        else platform.processor() or platform.machine()
    )
    record = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{device}, {torch.get_num_threads()} threads",
        "torch": torch.__version__,
        "lossweight": lossweight.__version__,
        "settings": {k: v for k, v in vars(args).items() if k != "json"},
        "steps": results,
        "overhead": overhead,
    }
    if args.json is not None:
        args.json.write_text(json.dumps(record, indent=2, default=str) + "\n")
    print(f"{record['date']}, {record['machine']}, torch {record['torch']}\n")
    print(markdown(results, overhead))
    for line in targets(results, overhead) if results else []:
        print(line)


if __name__ == "__main__":
    main()
