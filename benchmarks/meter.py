"""What a variant's steps issue and read back: collectives, their bytes, host syncs."""

from __future__ import annotations

import contextlib
import warnings
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator

import torch

from lossweight.testing import count_collectives

HOST_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__")


class Meter:
    """Counts, per variant, over the steps run inside ``counting(name)``:

    - the collectives, where they reach the process group's backend, so DDP's gradient
      all-reduce is among them, and the bytes this rank contributes to them;
    - the host syncs: on the CPU the Tensor methods that read a value back
      (``HOST_READS``), on a GPU also the syncs CUDA reports.

    Counting intercepts every tensor operation, so it is done in steps that are not timed.
    """

    def __init__(self) -> None:
        self.steps: Counter[str] = Counter()
        self.collectives: dict[str, Counter[str]] = defaultdict(Counter)
        self.bytes: Counter[str] = Counter()
        self.host_reads: Counter[str] = Counter()
        self.device_syncs: Counter[str] = Counter()

    @contextlib.contextmanager
    def counting(self, name: str) -> Iterator[None]:
        """Count what one step of ``name`` inside the block does."""
        reads = 0

        def counted(original: Callable) -> Callable:
            def call(tensor, *args):
                nonlocal reads
                reads += 1
                return original(tensor, *args)

            return call

        originals = {method: getattr(torch.Tensor, method) for method in HOST_READS}
        cuda = torch.cuda.is_available()
        for method, original in originals.items():
            setattr(torch.Tensor, method, counted(original))
        try:
            with warnings.catch_warnings(record=True) as caught, count_collectives() as seen:
                warnings.simplefilter("always")
                if cuda:
                    torch.cuda.set_sync_debug_mode("warn")
                try:
                    yield
                finally:
                    if cuda:
                        torch.cuda.set_sync_debug_mode("default")
        finally:
            for method, original in originals.items():
                setattr(torch.Tensor, method, original)
        self.steps[name] += 1
        self.collectives[name].update(seen.calls)
        self.bytes[name] += sum(seen.bytes.values())
        self.host_reads[name] += reads
        self.device_syncs[name] += sum("synchroniz" in str(w.message) for w in caught)

    def per_step(self, name: str, baseline: str) -> dict:
        """``name``'s figures per step; its collectives and bytes both in all and beyond
        ``baseline``'s (the plain loop's: DDP's own gradient reduction)."""
        steps, base_steps = self.steps[name], self.steps[baseline]
        calls = {op: n / steps for op, n in self.collectives[name].items()}
        base_calls = {op: n / base_steps for op, n in self.collectives[baseline].items()}
        beyond = {op: calls.get(op, 0) - base_calls.get(op, 0) for op in {*calls, *base_calls}}
        return {
            "collectives_per_step": {op: n for op, n in sorted(beyond.items()) if n},
            "bytes_per_step": self.bytes[name] / steps - self.bytes[baseline] / base_steps,
            "all_collectives_per_step": dict(sorted(calls.items())),
            "all_bytes_per_step": self.bytes[name] / steps,
            "host_reads_per_step": self.host_reads[name] / steps,
            "device_syncs_per_step": (
                self.device_syncs[name] / steps if torch.cuda.is_available() else None
            ),
        }
