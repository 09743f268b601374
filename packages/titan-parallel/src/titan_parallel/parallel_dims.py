"""Parallel degrees, their validation, and the named device mesh they define."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from titan_parallel.errors import ParallelConfigError

logger = logging.getLogger(__name__)

# Outermost to innermost: tp is innermost so its ranks are neighbours (same node, fastest links).
MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")

# Flattened views of the mesh, by use: `dp` for data loading (ranks that read different batches),
# `dp_shard_cp` for sharding parameters, `dp_cp` for averaging the loss.
FLAT_VIEWS = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
}


@dataclass
class ParallelDims:
    """Degrees of each parallelism; `dp_shard=-1` takes whatever the others leave of `world_size`."""

    dp_replicate: int = 1
    dp_shard: int = -1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    world_size: int = 1
    _mesh: DeviceMesh | None = field(default=None, init=False, repr=False)
    _views: dict[str, DeviceMesh] = field(default_factory=dict, init=False, repr=False)

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

    def check_model(
        self,
        *,
        n_layers: int | None = None,
        n_heads: int | None = None,
        n_kv_heads: int | None = None,
        seq_len: int | None = None,
        vocab_size: int | None = None,
        stages_per_rank: int = 1,
        sequence_parallel: bool = True,
    ) -> None:
        """Refuse a layout that this model cannot be split into; each error names the numbers and the fix.

        Only the given sizes are checked. `stages_per_rank` is 2 for interleaved and V schedules.
        """
        if self.tp > 1:
            for name, heads in (("n_heads", n_heads), ("n_kv_heads", n_kv_heads)):
                if heads is not None and heads % self.tp:
                    raise ParallelConfigError(
                        f"parallelism: tp({self.tp}) does not divide the model's {name} ({heads}); each "
                        f"tensor-parallel rank holds whole heads, so choose tp among the divisors of {heads}"
                    )
            if vocab_size is not None and vocab_size % self.tp:
                raise ParallelConfigError(
                    f"parallelism: tp({self.tp}) does not divide vocab_size ({vocab_size}); the embedding and "
                    "output head are split by vocabulary, so pad the vocabulary to a multiple of tp"
                )
        if seq_len is not None:
            self._check_seq_len(seq_len, sequence_parallel)
        if n_layers is not None and self.pp * stages_per_rank > n_layers:
            raise ParallelConfigError(
                f"parallelism: pp({self.pp}) * stages per rank({stages_per_rank}) = "
                f"{self.pp * stages_per_rank} pipeline stages, but the model has only {n_layers} layers; "
                "every stage needs at least one layer, so lower pp or use a single-stage schedule"
            )

    def _check_seq_len(self, seq_len: int, sequence_parallel: bool) -> None:
        # Causal context parallelism balances load by cutting each sequence into 2*cp chunks; sequence
        # parallelism then splits what a rank holds across tp ranks.
        factors = []
        if self.cp > 1:
            factors.append((f"2*cp({self.cp})", 2 * self.cp))
        if self.tp > 1 and sequence_parallel:
            factors.append((f"tp({self.tp})", self.tp))
        needed = 1
        for _, f in factors:
            needed *= f
        if seq_len % needed:
            names = " * ".join(n for n, _ in factors)
            raise ParallelConfigError(
                f"parallelism: seq_len ({seq_len}) is not divisible by {names} = {needed}; context "
                "parallelism cuts each sequence into 2*cp chunks and sequence parallelism splits them "
                f"across tp ranks, so choose a seq_len that is a multiple of {needed}"
            )

    @property
    def degrees(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in MESH_ORDER}

    @property
    def dp_enabled(self) -> bool:
        return self.dp_replicate * self.dp_shard > 1

    @property
    def fsdp_enabled(self) -> bool:
        """Parameters are sharded: over dp_shard, and over cp too since cp ranks hold the same weights."""
        return self.dp_shard * self.cp > 1

    @property
    def ddp_enabled(self) -> bool:
        return self.dp_replicate > 1 and not self.fsdp_enabled

    @property
    def dp_degree(self) -> int:
        """Number of data-parallel replicas of the batch (what the data loader shards over)."""
        return self.dp_replicate * self.dp_shard

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Create the world mesh with named dims (size-1 dims dropped) and every view `submesh` names."""
        dims = [(name, degree) for name, degree in self.degrees.items() if degree > 1]
        if not dims:
            dims = [("dp_shard", 1)]
        names = tuple(name for name, _ in dims)
        mesh = init_device_mesh(device_type, tuple(d for _, d in dims), mesh_dim_names=names)
        # Views are kept here rather than sliced from the root later: torch is retiring slicing a
        # flattened dim out of the root mesh.
        views: dict[str, DeviceMesh] = {name: mesh[name] for name in names if self.degrees[name] > 1}
        for flat, parts in FLAT_VIEWS.items():
            present = tuple(p for p in parts if p in views)
            if len(present) == 1:
                views[flat] = views[present[0]]
            elif present:
                views[flat] = mesh[present]._flatten(mesh_dim_name=flat)
        replicate, shard = views.get("dp_replicate"), views.get("dp_shard_cp")
        if replicate is not None and shard is not None:
            # HSDP: dp_cp unflattened into (replicate, shard) keeps the ranks of both 1-D views.
            views["fsdp"] = views["dp_cp"]._unflatten(
                0, (self.dp_replicate, shard.size()), ("dp_replicate", "dp_shard_cp")
            )
        elif replicate is not None or shard is not None:
            views["fsdp"] = replicate if shard is None else shard
        logger.info("device mesh %s on %s", dict(dims), device_type)
        self._mesh, self._views = mesh, views
        return mesh

    @property
    def mesh(self) -> DeviceMesh:
        if self._mesh is None:
            raise RuntimeError("ParallelDims.build_mesh() must be called before .mesh is used")
        return self._mesh

    def submesh(self, name: str) -> DeviceMesh | None:
        """A named dimension or view of the mesh, or None where its degree is 1.

        Names: each of MESH_ORDER, the flattened views "dp" (data loading), "dp_shard_cp"
        (parameter sharding), "dp_cp" (loss averaging), and "fsdp" (the 1-D or, for HSDP, 2-D
        replicate x shard mesh that dense parameters live on).
        """
        known = (*MESH_ORDER, *FLAT_VIEWS, "fsdp")
        if name not in known:
            raise ParallelConfigError(f"parallelism: unknown mesh name '{name}'; choose one of {list(known)}")
        if self._mesh is None:
            raise RuntimeError("ParallelDims.build_mesh() must be called before .submesh() is used")
        return self._views.get(name)
