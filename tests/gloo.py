"""Real torch.distributed gloo ranks for the multi-process tests, with a deadline on progress.

``run_ranks(world_size, function, *args)`` starts ``world_size`` processes (multiprocessing's
"spawn" context), joins them into one gloo process group through a file in a fresh temporary
directory, runs ``function(rank, world_size, *args)`` on each, and returns one :class:`Outcome`
per rank: the function's JSON-able return value, or the type, message and traceback of what it
raised. ``function`` must be a module-level function and ``args`` picklable.

Whatever the ranks do, the call returns or fails once they have made no progress for
``deadline`` seconds (no rank used CPU time: they sleep, or wait for each other), or after
``CAP`` times that and a minute in all, so that ranks spinning without end cannot hold CI: a
rank still running then has its Python stacks dumped (faulthandler) and is SIGKILLed, and the
call raises an AssertionError naming the ranks that hung, with their stacks. A machine that is
busy with other work slows the ranks down but does not stop their progress, so a healthy launch
is not killed for it. A rank that dies without reporting (a signal, a crash at start-up) fails
the call the same way, at once.
"""

from __future__ import annotations

import faulthandler
import gc
import json
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
import types
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

# How long one gloo collective (and the rendezvous) may wait for the other ranks. A healthy
# collective of these tests waits only for its peers' compute between two calls: tiny fp64
# models, milliseconds even with 4 processes sharing the 2 cores of the CI machine, so 10 s
# leaves a wide margin for scheduling noise. Short, because a test whose ranks pair their
# collectives wrongly must fail in seconds, not after torch's default of 30 minutes, and well
# within the deadline, so that it fails as an error on the rank (with its traceback) rather
# than as a kill.
COLLECTIVE_TIMEOUT = 10.0
# How long the ranks of a launch may go without progress (no rank using CPU time) before they
# are killed: room for a collective timeout, which ends a rank's wait on its own. Launches pass
# their own, sized to their work. CAP bounds a launch whose ranks spin without end: a loaded
# machine (a busy process per core) makes a launch about 1.5 times slower.
DEADLINE = 45.0
CAP = 5
_POLL = 0.02
_PROGRESS = 5  # clock ticks of CPU time (50 ms at the usual 100 a second)


@dataclass(frozen=True)
class Outcome:
    """What one rank's ``function`` did: returned ``value``, or raised ``error`` (the type's
    name) with ``message`` and ``traceback``. ``seconds``: how long ``function`` ran."""

    rank: int
    value: Any = None
    error: str | None = None
    message: str = ""
    traceback: str = ""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None

    def describe(self) -> str:
        if self.ok:
            return f"rank {self.rank} returned {self.value!r} after {self.seconds:.1f} s"
        return f"rank {self.rank} raised {self.error}: {self.message}\n{self.traceback}"


def values(outcomes: list[Outcome]) -> list[Any]:
    """Every rank's return value; an AssertionError with every failure if any rank raised."""
    failed = [outcome for outcome in outcomes if not outcome.ok]
    if failed:
        raise AssertionError("\n".join(outcome.describe() for outcome in failed))
    return [outcome.value for outcome in outcomes]


def run_ranks(
    world_size: int,
    function: Callable[..., Any],
    *args: Any,
    collective_timeout: float = COLLECTIVE_TIMEOUT,
    deadline: float = DEADLINE,
    init_group: bool = True,
) -> list[Outcome]:
    """Run ``function(rank, world_size, *args)`` on ``world_size`` gloo ranks (see the module
    docstring). With ``init_group=False`` the harness leaves the default process group to
    ``function``, which calls :func:`init_process_group` when it wants it."""
    context = multiprocessing.get_context("spawn")
    directory = Path(tempfile.mkdtemp(prefix="lossweight-gloo-"))
    start = time.monotonic()
    processes = [
        context.Process(
            target=_rank_main,
            args=(rank, world_size, str(directory), collective_timeout, init_group, function, args),
            name=f"gloo-rank-{rank}",
        )
        for rank in range(world_size)
    ]
    try:
        for process in processes:
            process.start()
        hung, crashed = _wait(processes, directory, start, deadline)
        if hung or crashed:
            raise AssertionError(_failure(function, deadline, directory, processes, hung, crashed))
        return [_read_outcome(directory, rank) for rank in range(world_size)]
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
            if process.pid is not None:
                process.join()
        shutil.rmtree(directory, ignore_errors=True)


def _cpu_ticks(processes: list[multiprocessing.process.BaseProcess], directory: Path) -> int | None:
    """The CPU time that the ranks still at work (not yet reported) have used so far, in clock
    ticks; None where /proc cannot tell (not Linux): the deadline then counts from the start."""
    total = 0
    for rank, process in enumerate(processes):
        if _result_path(directory, rank).exists():  # done: it only waits for the others
            continue
        try:  # utime and stime: the 14th and 15th fields, the 12th and 13th after the name
            fields = Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except FileNotFoundError:  # exited: it made its progress
            continue
        except (OSError, ValueError, IndexError):
            return None
    return total


def _wait(
    processes: list[multiprocessing.process.BaseProcess],
    directory: Path,
    start: float,
    deadline: float,
) -> tuple[list[int], list[int]]:
    """Wait until every rank has exited, a rank has died without reporting, or the ranks have
    made no progress for ``deadline`` seconds (or run ``CAP`` times that and a minute); then
    SIGKILL what still runs. Returns (ranks that hung, ranks that crashed)."""

    def crashed() -> list[int]:
        return [
            rank
            for rank, process in enumerate(processes)
            if process.exitcode not in (None, 0) and not _result_path(directory, rank).exists()
        ]

    ticks, progressed = _cpu_ticks(processes, directory), start
    # Stop at a crash too: its peers would only wait for it until their collectives time out.
    while any(p.is_alive() for p in processes) and not crashed():
        now = time.monotonic()
        if now - progressed > deadline or now - start > CAP * deadline + 60:
            break
        # Progress: the ranks at work used a few clock ticks more (a rank that waits, polling
        # or in a collective, uses hardly any).
        used = _cpu_ticks(processes, directory)
        if ticks is not None and used is not None and used - ticks >= _PROGRESS:
            ticks, progressed = used, now
        time.sleep(_POLL)
    died = crashed()  # before the kills below, which are not crashes
    hung = [
        rank
        for rank, process in enumerate(processes)
        if process.is_alive() and not _result_path(directory, rank).exists()
    ]
    for rank in hung:  # ask for their stacks before killing them
        os.kill(processes[rank].pid, signal.SIGUSR1)  # type: ignore[arg-type]
    if hung:
        time.sleep(0.5)
    for process in processes:
        if process.is_alive():
            process.kill()
        process.join()
    return hung, died


def _failure(
    function: Callable[..., Any],
    deadline: float,
    directory: Path,
    processes: list[multiprocessing.process.BaseProcess],
    hung: list[int],
    crashed: list[int],
) -> str:
    name = f"{function.__module__}.{function.__qualname__}"
    lines = []
    for rank in crashed:
        code = processes[rank].exitcode
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"  # type: ignore[operator]
        lines.append(f"{name}: rank {rank} died with {how} before reporting an outcome")
    if hung and crashed:
        lines.append(f"{name}: rank(s) {hung} still running then, SIGKILLed")
    elif hung:
        lines.append(
            f"{name}: rank(s) {hung} of {len(processes)} hung: still running after "
            f"{deadline:g} s without progress, SIGKILLed"
        )
    for rank in range(len(processes)):
        if _result_path(directory, rank).exists():
            lines.append(_read_outcome(directory, rank).describe())
        stacks = directory / f"stacks{rank}.txt"
        if (rank in hung or rank in crashed) and stacks.exists() and stacks.stat().st_size:
            when = "when killed" if rank in hung else "when it died"
            lines.append(f"rank {rank}'s stacks {when}:\n{stacks.read_text()}")
    return "\n".join(lines)


def _result_path(directory: Path, rank: int) -> Path:
    return directory / f"result{rank}.json"


def _read_outcome(directory: Path, rank: int) -> Outcome:
    record = json.loads(_result_path(directory, rank).read_text())
    return Outcome(rank=rank, **record)


# Set in each rank's process, for init_process_group().
_INIT: dict[str, Any] = {}


def init_process_group() -> None:
    """Join this rank to the gloo default process group of its launch (for functions run with
    ``init_group=False``)."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"file://{_INIT['directory']}/init",
        rank=_INIT["rank"],
        world_size=_INIT["world_size"],
        timeout=timedelta(seconds=_INIT["collective_timeout"]),
    )


def _rank_main(
    rank: int,
    world_size: int,
    directory: str,
    collective_timeout: float,
    init_group: bool,
    function: Callable[..., Any],
    args: tuple[Any, ...],
) -> None:
    folder = Path(directory)
    parent = os.getppid()
    # The Python stacks of every thread, for the parent's report: on SIGUSR1 (sent to a rank
    # about to be killed for hanging) and on a fatal signal (SIGSEGV, SIGABRT).
    stacks = open(folder / f"stacks{rank}.txt", "w")  # noqa: SIM115 (open until the exit)
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    faulthandler.enable(file=stacks, all_threads=True)
    record: dict[str, Any]
    started = time.monotonic()
    try:
        import torch

        torch.set_num_threads(1)
        _INIT.update(
            directory=directory,
            rank=rank,
            world_size=world_size,
            collective_timeout=collective_timeout,
        )
        # Start together: the rendezvous then waits for nobody's imports, which on a loaded
        # machine could take a good part of the collective timeout.
        _gather(folder, "ready", rank, world_size, parent)
        if init_group:
            init_process_group()
        started = time.monotonic()
        value = function(rank, world_size, *args)
        record = {"value": json.loads(json.dumps(value))}
    except BaseException as error:
        record = {
            "error": type(error).__name__,
            "message": str(error),
            "traceback": traceback.format_exc(),
        }
    record["seconds"] = time.monotonic() - started
    temporary = folder / f"result{rank}.json.tmp"
    temporary.write_text(json.dumps(record))
    os.replace(temporary, _result_path(folder, rank))
    # Leave only once every rank has reported: a rank that closed its sockets early could cut
    # off data that a peer's last collective still reads from them.
    _gather(folder, "result", rank, world_size, parent, suffix=".json")
    sys.stdout.flush()
    sys.stderr.flush()
    # Exit at once, without the interpreter's teardown: a process that used DDP and FSDP2 in
    # one run aborted there with SIGABRT ("terminate called without an active exception") in
    # about 15% of runs, after its work had succeeded and been reported. Nothing after this
    # point needs the teardown: the outcome is on disk and the streams are flushed.
    os._exit(0)


def _gather(
    folder: Path, name: str, rank: int, world_size: int, parent: int, suffix: str = ""
) -> None:
    """Wait until every rank has written ``{name}{rank}{suffix}``. The parent's deadline bounds
    the wait; a rank whose parent died (killed with the test run) exits instead."""
    if name == "ready":
        (folder / f"ready{rank}").touch()
    paths = [folder / f"{name}{other}{suffix}" for other in range(world_size)]
    while not all(path.exists() for path in paths):
        if os.getppid() != parent:
            os._exit(1)
        time.sleep(_POLL)


# For the harness's own tests, here in a module that imports nothing heavy, so that their ranks
# start fast.


def raise_or_hang(rank: int, world_size: int) -> None:
    """Rank 0 raises, the others hang."""
    if rank == 0:
        raise ValueError("rank 0 gives up")
    time.sleep(3600)


def busy_for(rank: int, world_size: int, seconds: float) -> int:
    """Compute for ``seconds`` of CPU time (a slow, healthy rank), then return the rank."""
    used = time.process_time()
    while time.process_time() - used < seconds:
        pass
    return rank


def abort_or_wait(rank: int, world_size: int) -> None:
    """Rank 1 aborts as a C++ terminate() would, the others wait for it."""
    import torch.distributed as dist

    # Every rank past the group's set-up first: a rank that aborts while the others still
    # connect makes them fail at once (and report), which is not what this checks.
    dist.barrier()
    if rank == 1:
        os.abort()
    time.sleep(3600)


def holds_a_process_group(*roots: object) -> bool:
    """Whether a ``ProcessGroup`` is reachable from ``roots`` through Python references, not
    counting what a ``DeviceMesh`` holds (the caller's own object) or module, class and
    function globals. A group that outlives ``destroy_process_group()`` this way is freed at
    interpreter exit, where gloo may abort the process: torch's, but lossweight must not be
    the one that keeps it."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    opaque = (DeviceMesh, torch.Tensor, type, types.ModuleType, types.FunctionType)
    seen: set[int] = set()
    stack = list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, opaque):
            continue
        seen.add(id(obj))
        if isinstance(obj, dist.ProcessGroup):
            return True
        stack.extend(gc.get_referents(obj))
    return False
