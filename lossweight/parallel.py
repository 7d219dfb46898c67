"""Parallel layouts beyond plain data parallelism: the core's
:class:`lossweight.collectives.ParallelLayout` for a ``DeviceMesh``.

A ``DeviceMesh`` as the group: its data-parallel (and context-parallel) dimensions flattened
into one process group, the ranks of its root's tensor-parallel dimensions joined to that
reduction and checked to give the same counts, and the stages of a ``pipeline=`` dimension
sharing it, the last one computing the loss. The core imports this module only when an
Accumulator is given a mesh: a vendorer of plain data parallelism leaves it out
(docs/vendoring.md). Every private torch call it makes is here.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from . import _torch
from .errors import DisagreementError, add_messages, error

# The rows of this module's errors, added to lossweight.errors.MESSAGES when it is imported.
# fmt: off
_MESSAGES: dict[str, tuple[type[Exception], str]] = {
    "mesh_unnamed": (ValueError, "group={mesh!r} is a DeviceMesh of several dimensions without names; name them (init_device_mesh(..., mesh_dim_names=('dp', 'cp'))), so that its ranks can be flattened into one group"),
    "mesh_model_parallel": (ValueError, "group={mesh!r} has the mesh dimension {name!r}, whose ranks hold the same data (tensor or pipeline parallel): counting over it would count each item once per rank of it; pass the data-parallel dimensions only, such as group=mesh['dp', 'cp'], or for pipeline stages, name their dimension: group=mesh['pp', 'dp'], pipeline='pp'"),
    "mesh_partial": (ValueError, "group={mesh!r} holds part of a dimension of its root mesh {root!r} (as a mesh made with DeviceMesh._unflatten does), so lossweight cannot see which of the root's ranks hold the same data as which; make the mesh with init_device_mesh(..., mesh_dim_names=...) and pass group= a slice of it by name, such as group=mesh['dp']"),
    "peers_differ": (DisagreementError, "lossweight: ranks that differ only along the mesh dimensions {dimensions} of the group's root mesh, which group= does not span, gave different counts or losses in one reduction of a step. The ranks along a dimension outside group= must hold the same data, as tensor-parallel ranks do: the reduction spans them and counts each item once. If the ranks along {dimensions} hold different data (data or context parallel, a dimension of HSDP), count over it: {count_over}; if they are tensor-parallel ranks, give each the counts of the whole batch, not of its own shard (of a vocabulary-parallel loss's labels, say); if they are pipeline stages, name their dimension in group= and pipeline= (group=mesh['pp', 'dp'], pipeline='pp')"),
}
# fmt: on
add_messages(_MESSAGES)

if TYPE_CHECKING:
    from .collectives import Microbatches
    from .terms import Layout

# Names of mesh dimensions whose ranks hold the same data: tensor, expert-tensor and pipeline
# parallel. Refused in group=, where every dimension must hold different data; outside it, a
# dimension is checked by its data, whatever its name.
_MODEL_PARALLEL = {"tp", "etp", "pp"}


class MeshGroup:
    """The ranks of ``mesh`` as the step's one reduction, checked when the Accumulator is made:
    a :class:`lossweight.collectives.ParallelLayout`.

    ``stages``: how many pipeline stages the ranks are split into (along ``pipeline``), and
    whether this rank holds the last, which computes the loss. ``peers``: the dimensions of the
    root mesh that ``mesh`` does not span, found from the ranks it holds, not from names: their
    ranks must hold the same data (tensor parallel), so the reduction spans them too, and each
    group of ranks along each of them is fingerprinted (``extend``) and checked to give the
    same counts; only the ranks last along every one of them add up counts and losses (the
    last of pipeline stages left out of group= computes the loss). The ``group()`` is made
    when a step begins."""

    def __init__(self, mesh: DeviceMesh, pipeline: str | None) -> None:
        names = mesh.mesh_dim_names or ()
        if pipeline is not None and (not isinstance(pipeline, str) or pipeline not in names):
            raise error("pipeline_dimension", value=pipeline, group=mesh, names=names)
        if mesh.ndim > 1 and len(names) < mesh.ndim:
            raise error("mesh_unnamed", mesh=mesh)
        if model_parallel := [n for n in names if n != pipeline and not _data([n])]:
            raise error("mesh_model_parallel", mesh=mesh, name=model_parallel[0])
        self.mesh, self.stages = mesh, (1, True)
        if pipeline is not None:
            size = mesh.size(dim := names.index(pipeline))
            self.stages = (size, mesh.get_local_rank(dim) == size - 1)
        self._root = root = mesh._get_root_mesh()
        # Along each dimension of the root, the ranks that differ from this one there alone
        # (a column of the root's ranks with that dimension first): the dimension is outside
        # the group when mesh holds none of them.
        held, rank = set(mesh.mesh.flatten().tolist()), root.get_rank()
        names = root.mesh_dim_names or tuple(map(str, range(root.ndim)))
        peers, self._groups, self._last = [], [], True  # groups: (size, how many, this one)
        for dim, name in enumerate(names):
            grid = root.mesh.movedim(dim, 0).reshape(root.size(dim), -1)
            index = int((grid == rank).nonzero()[0, 1])
            along = set(grid[:, index].tolist()) - {rank}
            if along and not along & held:
                peers.append(name)
                self._groups.append((grid.shape[0], grid.shape[1], index))
                self._last = self._last and int(grid[-1, index]) == rank
        self.peers = tuple(peers)
        self._size = math.prod(size for size, _, _ in self._groups)
        if mesh.size() * self._size != root.size():  # part of a dimension: which ranks hold what?
            raise error("mesh_partial", mesh=mesh, root=root)

    def group(self) -> dist.ProcessGroup:
        """The process group over the mesh's ranks and its peers' (``DeviceMesh._flatten``,
        cached by torch; made on every rank of the root mesh at once, as ``begin()`` is)."""
        mesh = self._root if self.peers else self.mesh
        return mesh.get_group() if mesh.ndim == 1 else mesh._flatten().get_group()

    def replicas(self, world_size: int) -> int:
        """The data-parallel ranks among the reduction's ``world_size``: ``D``'s world."""
        return world_size // self.stages[0] // self._size

    def extend(
        self, payload: torch.Tensor, layout: Layout, microbatches: Microbatches
    ) -> torch.Tensor:
        """``payload`` and, for each group of peers, the sum of its ranks' fingerprints and of
        their losses (each rank's loss slots in one number), then the sums of their squares:
        over ``T`` peers ``T * f`` and ``T * f**2`` if and only if every one sent the same
        ``f``. The fingerprint is of the rank's totals and each microbatch's counts, in order,
        since each microbatch's factor comes from its own counts. Only the last peer's counts
        and losses are added up. Without peers, ``payload`` as it is."""
        if not self.peers:
            return payload
        # The numbers on the host go in one copy that does not wait for the device, then each
        # tensor back in its place: the same counts, as numbers or as tensors, in the same order.
        host, tensors = array("d", [len(microbatches)]), []
        for counts in microbatches.values():
            counts = () if counts is None else counts
            host.append(len(counts))
            for c in [counts] if isinstance(counts, torch.Tensor) else counts:
                if isinstance(c, torch.Tensor):
                    copied = c.to(payload.device, torch.float64, non_blocking=True)
                    tensors.append((len(host), copied))
                else:
                    host.append(c)  # type: ignore[arg-type]
        numbers = _torch.float64s(host, payload.device)
        rows, start = [payload[layout.counts]], 0
        for end, tensor in tensors:
            rows += [numbers[start:end], tensor.reshape(-1)]
            start = end
        rows.append(numbers[start:])
        fingerprint = fingerprint_of(torch.cat(rows)).to(payload.dtype)
        # The losses too, which ranks of other data give even where their counts agree: every
        # loss slot in one number, which the same losses give alike.
        losses = torch.cat([payload[sums] for sums, _ in layout.losses])
        loss = (losses * torch.arange(1.0, len(losses) + 1, device=losses.device)).sum()
        values, blocks = torch.stack((fingerprint, loss)), [payload]
        for _, groups, index in self._groups:
            block = payload.new_zeros(4, groups)
            block[:, index] = torch.cat((values, values * values))
            blocks.append(block.view(-1))
        if not self._last:
            payload[layout.counts.start :] = 0
        return torch.cat(blocks)

    def agreement(self, summed: torch.Tensor) -> torch.Tensor:
        """Along each dimension of ``peers``, whether every group of its ranks sent the same
        fingerprint (computed exactly in int64) and losses that differ by no more than
        round-off (a relative spread of 1e-6; a non-finite loss is not compared), from
        ``extend()``'s slots summed (bool)."""
        agree, start = [], 0
        for size, groups, _ in self._groups:
            sums, losses, squares, loss_squares = summed[start : start + 4 * groups].view(4, -1)
            sums, squares = sums.to(torch.int64), squares.to(torch.int64)
            mean = sums // size  # the same f from every one: sums T * f, squares T * f**2
            exact = (sums == mean * size) & (squares == mean * mean * size)
            average = losses / size
            spread = loss_squares / size - average * average
            close = ~(spread > (1e-6 * average) ** 2)  # NaN: not compared
            agree.append((exact & close).all())
            start += 4 * groups
        return torch.stack(agree)

    def messages(self) -> list[str]:
        """The words of each dimension's check where they must be fixed (a compiled assert)."""
        return [str(self.refusal([n != name for n in self.peers])) for name in self.peers]

    def refusal(self, passed: Sequence[bool]) -> Exception:
        """The error of the peers along the dimensions whose checks (the last of ``passed``,
        one bool each) fail."""
        agree = passed[len(passed) - len(self.peers) :]
        differing = tuple(name for name, same in zip(self.peers, agree, strict=True) if not same)
        root = self._root  # its dimensions that would count: of size 2 or more, data ones
        names = [n for i, n in enumerate(root.mesh_dim_names or ()) if root.size(i) > 1]
        kept = [n for n in names if n not in self.peers or n in differing]
        count_over = f"group=mesh{_data(kept) or kept}"
        if not _data(differing):  # named tensor or pipeline parallel: group= refuses it so named
            count_over = (
                "rename it (tp, etp and pp say its ranks hold the same data), add it to group="
            )
        return error("peers_differ", dimensions=differing, count_over=count_over)


def _data(names: Sequence[str]) -> list[str]:
    """The dimension names that do not say tensor, expert-tensor or pipeline parallel."""
    return [name for name in names if not set(name.split("_")) & _MODEL_PARALLEL]


# A fingerprint of a rank's counts (their float64 bits, in 16-bit pieces, each times a weight
# of its place), modulo a prime above 2**16: counts that differ in one piece always differ in
# it; others only where the weighted sum of their pieces' differences is a multiple of the
# prime. Exact: a fingerprint's square is below 2**40, the sums of 2**13 of them below 2**53,
# and the check compares them in int64 with T * m and T * m**2, m = sum(f) // T: equal only
# if every f is m (a sum of squares is T * m**2 at least, and equal only then).
_PRIME = 2**20 - 3


def fingerprint_of(values: torch.Tensor) -> torch.Tensor:
    """A 0-dim int64 in [0, 2**20) of a 1-D float64 tensor's bits (see above)."""
    pieces = values.view(torch.int64)[:, None] >> torch.arange(0, 64, 16, device=values.device)
    weights = torch.arange(1, pieces.numel() + 1, device=values.device).view_as(pieces)
    return (pieces.bitwise_and(0xFFFF) * (weights * 40503 % _PRIME)).sum() % _PRIME
