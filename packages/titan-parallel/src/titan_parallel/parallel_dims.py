"""Parallel degrees, their validation, and the named device mesh they define."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from titan_parallel.errors import ParallelConfigError

logger = logging.getLogger(__name__)

# Outermost to innermost: tp is innermost so its ranks are neighbours (same node, fastest links).
MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")

# Flattened views of the mesh, by use: `dp` for data loading, `dp_shard_cp` for sharding parameters,
# `dp_cp` for averaging the loss.
FLAT_VIEWS = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
}


@dataclass
class ParallelDims:
    """Degrees of each parallelism; `dp_shard=-1` takes whatever the others leave of `world_size`."""

    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    world_size: int
    _mesh: DeviceMesh | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self._validate()

    def _validate(self) -> None:
        named = {"dp_replicate": self.dp_replicate, "cp": self.cp, "tp": self.tp, "pp": self.pp}
        for name, degree in named.items():
            if degree < 1:
                raise ParallelConfigError(f"parallelism: {name} must be >= 1, got {degree}")
        if self.dp_shard == 0 or self.dp_shard < -1:
            raise ParallelConfigError(
                f"parallelism: dp_shard must be -1 (infer) or >= 1, got {self.dp_shard}"
            )
        others = self.dp_replicate * self.cp * self.tp * self.pp
        if self.dp_shard == -1:
            if self.world_size % others:
                raise ParallelConfigError(
                    f"parallelism: dp_replicate({self.dp_replicate}) * cp({self.cp}) * tp({self.tp}) * "
                    f"pp({self.pp}) = {others} does not divide WORLD_SIZE {self.world_size}; "
                    "choose degrees whose product divides the number of processes"
                )
            self.dp_shard = self.world_size // others
        product = others * self.dp_shard
        if product != self.world_size:
            raise ParallelConfigError(
                f"parallelism: dp_replicate({self.dp_replicate}) * dp_shard({self.dp_shard}) * cp({self.cp}) * "
                f"tp({self.tp}) * pp({self.pp}) = {product}, but WORLD_SIZE is {self.world_size}; "
                "set dp_shard = -1 to infer it, or change the degrees"
            )

    @property
    def degrees(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in MESH_ORDER}

    @property
    def dp_enabled(self) -> bool:
        return self.dp_replicate * self.dp_shard > 1

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def dp_degree(self) -> int:
        """Number of data-parallel replicas of the batch (what the data loader shards over)."""
        return self.dp_replicate * self.dp_shard

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Create the world mesh with named dims (size-1 dims dropped) and the flattened views."""
        dims = [(name, degree) for name, degree in self.degrees.items() if degree > 1]
        if not dims:
            dims = [("dp_shard", 1)]
        names = tuple(name for name, _ in dims)
        mesh = init_device_mesh(device_type, tuple(d for _, d in dims), mesh_dim_names=names)
        for flat, parts in FLAT_VIEWS.items():
            present = tuple(p for p in parts if p in names)
            if len(present) > 1:
                mesh[present]._flatten(mesh_dim_name=flat)
        logger.info("device mesh %s on %s", dict(dims), device_type)
        self._mesh = mesh
        return mesh

    @property
    def mesh(self) -> DeviceMesh:
        if self._mesh is None:
            raise RuntimeError("ParallelDims.build_mesh() must be called before .mesh is used")
        return self._mesh

    def submesh(self, name: str) -> DeviceMesh | None:
        """A named dimension or flattened view of the mesh, or None where its degree is 1."""
        mesh = self.mesh
        present = [p for p in FLAT_VIEWS.get(name, (name,)) if p in (mesh.mesh_dim_names or ())]
        if not present:
            return None
        return mesh[present[0]] if len(present) == 1 else mesh[name]
