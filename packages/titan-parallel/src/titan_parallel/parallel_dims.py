"""Parallel degrees, their validation, and the named device mesh they define.

Expert parallelism (`ep`) adds no ranks of its own: it reuses the ranks that hold different data
(dp_shard and cp, and tp too when `etp` = 1) to hold different experts. The same ranks therefore
get two views: the dense one (pp, dp_replicate, dp_shard, cp, tp) for every other parameter, and the
expert one (pp, dp_replicate, efsdp, ep, etp), where `efsdp` is what is left of dp_shard * cp * tp
after ep and etp took theirs; FSDP shards the experts over it.
"""

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

# Views that exist only with ep > 1 (see `submesh`).
EXPERT_VIEWS = ("ep", "efsdp", "etp", "experts", "experts_fsdp")


@dataclass
class ParallelDims:
    """Degrees of each parallelism; `dp_shard=-1` takes whatever the others leave of `world_size`."""

    dp_replicate: int = 1
    dp_shard: int = -1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    # torchtitan's expert_parallel_degree and expert_tensor_parallel_degree (1 or tp)
    ep: int = 1
    etp: int = 1
    world_size: int = 1
    _mesh: DeviceMesh | None = field(default=None, init=False, repr=False)
    _views: dict[str, DeviceMesh] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self._validate()

    def _validate(self) -> None:
        named = {
            "dp_replicate": self.dp_replicate,
            "cp": self.cp,
            "tp": self.tp,
            "pp": self.pp,
            "expert_parallel_degree": self.ep,
            "expert_tensor_parallel_degree": self.etp,
        }
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
        self._validate_experts()

    def _validate_experts(self) -> None:
        if self.etp not in (1, self.tp):
            raise ParallelConfigError(
                f"parallelism: expert_tensor_parallel_degree({self.etp}) must be 1 or tp({self.tp}); "
                "experts are split over the tensor-parallel ranks either all (etp = tp) or not at all"
            )
        if self.ep == 1:
            return
        borrowed = self.dp_shard * self.cp * (self.tp if self.etp == 1 else 1)
        names = f"dp_shard({self.dp_shard}) * cp({self.cp})" + (
            f" * tp({self.tp})" if self.etp == 1 < self.tp else ""
        )
        if borrowed % self.ep:
            raise ParallelConfigError(
                f"parallelism: expert_parallel_degree({self.ep}) does not divide {names} = {borrowed}; "
                "expert parallelism borrows its ranks from these dimensions"
                + (" (tp too, since expert_tensor_parallel_degree is 1)" if self.etp == 1 < self.tp else "")
                + ", so choose ep among the divisors of that product"
            )

    @property
    def efsdp(self) -> int:
        """Ranks that shard each expert with FSDP: dp_shard * cp * tp / (ep * etp)."""
        return self.dp_shard * self.cp * self.tp // (self.ep * self.etp)

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def expert_gradient_divide_factor(self) -> int:
        """What an expert's summed gradient is divided by: the ranks that see different tokens.

        Dense gradients are averaged over dp_replicate * dp_shard * cp; an expert's gradient arrives
        summed over its ep group already, so FSDP over the expert mesh must divide by that same
        product, not by the expert mesh's own size.
        """
        return self.dp_replicate * self.dp_shard * self.cp

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
        num_experts: int | None = None,
        expert_hidden_dim: int | None = None,
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
        if num_experts is not None and num_experts % self.ep:
            raise ParallelConfigError(
                f"parallelism: expert_parallel_degree({self.ep}) does not divide the model's num_experts "
                f"({num_experts}); each expert-parallel rank holds the same number of whole experts"
            )
        split = self.etp if self.ep > 1 else self.tp
        if expert_hidden_dim is not None and expert_hidden_dim % split:
            raise ParallelConfigError(
                f"parallelism: the experts' hidden dim ({expert_hidden_dim}) is not divisible by the "
                f"{'expert_tensor_parallel_degree' if self.ep > 1 else 'tp'}({split}) that splits it; "
                "choose a degree among its divisors"
            )
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
        if self.ep > 1:
            views.update(self._expert_views(mesh, views))
        logger.info("device mesh %s (ep %d, etp %d) on %s", dict(dims), self.ep, self.etp, device_type)
        self._mesh, self._views = mesh, views
        return mesh

    def _expert_views(self, mesh: DeviceMesh, views: dict[str, DeviceMesh]) -> dict[str, DeviceMesh]:
        """The expert view (dp_replicate, efsdp, ep, etp) of the non-pipeline ranks, and its sub-views."""
        dense = tuple(n for n in ("dp_replicate", "dp_shard", "cp", "tp") if n in views)
        flat = views[dense[0]] if len(dense) == 1 else mesh[dense]._flatten(mesh_dim_name="dense_ranks")
        # efsdp is kept even at size 1: the experts always get their own FSDP unit (see fsdp.py).
        sizes = {"dp_replicate": self.dp_replicate, "efsdp": self.efsdp, "ep": self.ep, "etp": self.etp}
        kept = {n: d for n, d in sizes.items() if d > 1 or n in ("efsdp", "ep")}
        expert = flat._unflatten(0, tuple(kept.values()), tuple(kept))
        out = {n: expert[n] for n in kept if n != "dp_replicate"}
        out["experts"] = expert["ep", "etp"] if self.etp > 1 else out["ep"]
        out["experts_fsdp"] = expert["dp_replicate", "efsdp"] if self.dp_replicate > 1 else out["efsdp"]
        return out

    @property
    def mesh(self) -> DeviceMesh:
        if self._mesh is None:
            raise RuntimeError("ParallelDims.build_mesh() must be called before .mesh is used")
        return self._mesh

    def submesh(self, name: str) -> DeviceMesh | None:
        """A named dimension or view of the mesh, or None where its degree is 1.

        Names: each of MESH_ORDER, the flattened views "dp" (data loading), "dp_shard_cp"
        (parameter sharding), "dp_cp" (loss averaging and the tokens-per-expert sum), and "fsdp"
        (the 1-D or, for HSDP, 2-D replicate x shard mesh that dense parameters live on). With
        ep > 1 also: "ep", "etp", "efsdp" (kept at size 1 too), "experts" (ep, or the 2-D
        ep x etp mesh the experts are split on) and "experts_fsdp" (efsdp, or dp_replicate x efsdp:
        the mesh FSDP shards experts over).
        """
        known = (*MESH_ORDER, *FLAT_VIEWS, "fsdp", *EXPERT_VIEWS)
        if name not in known:
            raise ParallelConfigError(f"parallelism: unknown mesh name '{name}'; choose one of {list(known)}")
        if self._mesh is None and self.world_size == 1:
            return None  # one process: every degree is 1, with or without a mesh (generation needs none)
        if self._mesh is None:
            raise RuntimeError("ParallelDims.build_mesh() must be called before .submesh() is used")
        return self._views.get(name)
