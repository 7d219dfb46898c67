"""Parallel layouts beyond plain data parallelism, behind the core's process-group collective.

A ``DeviceMesh`` as the group: its data-parallel (and context-parallel) dimensions flattened
into one process group, the ranks of its root's tensor-parallel dimensions joined to that
reduction and checked to give the same counts, and the stages of a ``pipeline=`` dimension
sharing it, the last one computing the loss. The core imports this module only when an
Accumulator is given a mesh: a vendorer of plain data parallelism leaves it out
(docs/vendoring.md). Every private torch call it makes is here.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .errors import device_message, error

if TYPE_CHECKING:
    from .terms import Layout

# Mesh dimensions whose ranks hold the same data: tensor, expert-tensor and pipeline parallel.
_TENSOR_PARALLEL = {"tp", "etp"}
_MODEL_PARALLEL = {*_TENSOR_PARALLEL, "pp"}


class MeshGroup:
    """The ranks of ``mesh`` as the step's one reduction, checked when the Accumulator is made.

    ``stages``: how many pipeline stages the ranks are split into (along ``pipeline``), and
    whether this rank holds the last, which computes the loss. ``peers``: the dimensions of the
    root mesh along which ranks hold the same data (tensor parallel) and which the reduction
    spans too: each group of peers is fingerprinted (``extend``), and only its first rank's
    counts and losses are added up. The ``group()`` is made when a step begins."""

    def __init__(self, mesh: DeviceMesh, pipeline: str | None) -> None:
        names = mesh.mesh_dim_names or ()
        if pipeline is not None and (not isinstance(pipeline, str) or pipeline not in names):
            raise error("pipeline_dimension", value=pipeline, group=mesh, names=names)
        if mesh.ndim > 1 and len(names) < mesh.ndim:
            raise error("mesh_unnamed", mesh=mesh)
        for name in names:
            if name != pipeline and set(name.split("_")) & _MODEL_PARALLEL:
                raise error("mesh_model_parallel", mesh=mesh, name=name)
        self.mesh, self.stages = mesh, (1, True)
        if pipeline is not None:
            size = mesh.size(dim := names.index(pipeline))
            self.stages = (size, mesh.get_local_rank(dim) == size - 1)
        # The root's tensor-parallel dimensions that mesh's ranks are not spread over; none
        # where torch has no DeviceMesh._concatenate to join them to mesh's.
        root = mesh._get_root_mesh() if hasattr(DeviceMesh, "_concatenate") else mesh
        tensor_parallel = [
            name
            for index, name in enumerate(root.mesh_dim_names or ())
            if set(name.split("_")) & _TENSOR_PARALLEL and root.size(index) > 1
        ]
        self.peers = tuple(name for name in tensor_parallel if name not in names)
        # Each group of peers: its size, how many groups, this rank's, and whether it is first.
        self._size, self._groups, self._index, self._first = 1, 1, 0, True
        if self.peers:
            self._size, self._groups = root[self.peers].size(), mesh.size()
            for size, place in zip(mesh.shape, mesh.get_coordinate() or (), strict=True):
                self._index = self._index * size + place
            self._first = all(root.get_local_rank(name) == 0 for name in self.peers)

    def group(self) -> dist.ProcessGroup:
        """The process group over the mesh's ranks and its peers' (``DeviceMesh._flatten``,
        cached by torch; made on every rank of the root mesh at once, as ``begin()`` is)."""
        mesh = self.mesh
        if self.peers:
            mesh = DeviceMesh._concatenate([mesh, mesh._get_root_mesh()[self.peers]])
        return mesh.get_group() if mesh.ndim == 1 else mesh._flatten().get_group()

    def replicas(self, world_size: int) -> int:
        """The data-parallel ranks among the reduction's ``world_size``: ``D``'s world."""
        return world_size // self.stages[0] // self._size

    def extend(
        self,
        payload: torch.Tensor,
        layout: Layout,
        microbatches: Mapping[str, Sequence[object] | torch.Tensor | None],
    ) -> torch.Tensor:
        """``payload`` and, for each group of peers, the sum of its ranks' fingerprints, then
        the sum of their squares: over ``T`` peers ``T * f`` and ``T * f**2`` if and only if
        every one sent the same ``f``. The fingerprint is of the rank's totals and each
        microbatch's counts, in order, since each microbatch's factor comes from its own
        counts. Only the first peer's counts and losses are added up."""
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
        numbers = torch.frombuffer(host, dtype=torch.float64).to(payload.device, non_blocking=True)
        rows, start = [payload[layout.counts]], 0
        for end, tensor in tensors:
            rows += [numbers[start:end], tensor.reshape(-1)]
            start = end
        rows.append(numbers[start:])
        fingerprint = fingerprint_of(torch.cat(rows))
        slots = payload.new_zeros(2, self._groups)
        slots[:, self._index] = torch.stack((fingerprint, fingerprint * fingerprint))
        if not self._first:
            payload[layout.counts.start :] = 0
        return torch.cat((payload, slots.view(-1)))

    def verdict(self, summed: torch.Tensor) -> torch.Tensor:
        """Whether every group's peers sent the same fingerprint, from ``extend()``'s slots
        summed (a 0-dim bool, computed exactly in int64)."""
        sums, squares = summed.view(2, -1).to(torch.int64)
        agree: torch.Tensor = (self._size * squares == sums * sums).all()
        return agree

    def message(self) -> str:
        return device_message("peers_differ", dimensions=self.peers)


# A fingerprint of a rank's counts (their float64 bits, in 16-bit pieces, each times a weight
# of its place), modulo a prime above 2**16: counts that differ in one piece always differ in
# it; others only where the weighted sum of their pieces' differences is a multiple of the
# prime. Exact: a fingerprint's square is below 2**40, the sums of 2**13 of them below 2**53,
# and the check compares T * sum(f**2) with sum(f)**2 in int64.
_PRIME = 2**20 - 3


def fingerprint_of(values: torch.Tensor) -> torch.Tensor:
    """A 0-dim int64 in [0, 2**20) of a 1-D float64 tensor's bits (see above)."""
    pieces = values.view(torch.int64)[:, None] >> torch.arange(0, 64, 16, device=values.device)
    weights = torch.arange(1, pieces.numel() + 1, device=values.device).view_as(pieces)
    return (pieces.bitwise_and(0xFFFF) * (weights * 40503 % _PRIME)).sum() % _PRIME
