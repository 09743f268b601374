"""Muon for the hidden matrices of a (possibly sharded) model, AdamW for the rest, in one optimizer.

Muon (Keller Jordan, 2024; `torch.optim.Muon`) replaces each matrix's momentum by its nearest
semi-orthogonal matrix, found with a few Newton-Schulz iterations. The orthogonalisation is a
function of the whole matrix: a row shard of FSDP, a column shard of tensor parallelism, or a slice
of a 2-D mesh cannot be orthogonalised on its own. So the split matrices of a mesh are shared out: each
is gathered whole, orthogonalised by one rank as in one process, and scattered back into every rank's
part (`Muon._step_shared`), the next round's gathers running under this round's Newton-Schulz. Stacked
expert weights [E, out, in] are E matrices, each orthogonalised on its own; where every placement shards
the expert dimension (expert parallelism, FSDP over experts) a rank already holds whole matrices and
nothing is gathered.

The momentum buffer is elementwise, so it stays sharded like its parameter and the optimizer state
checkpoints and reshards exactly as AdamW's does (DCP sees a DTensor of the parameter's layout).
Parameter groups carry `muon: True` (with `stacked`, the count of leading dims that index matrices)
or `muon: False` (AdamW, with torch's AdamW state names `step`, `exp_avg`, `exp_avg_sq`).
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.optim.adam import adam

from titan_parallel.errors import ModelDescriptionError, ParallelConfigError
from titan_parallel.protocols import HasHiddenMatrices

# Keller Jordan's quintic coefficients, torch.optim.Muon's defaults.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
ADJUST_LR_FNS = ("original", "match_rms_adamw")
# The dtypes Newton-Schulz may run in: bfloat16 is torch.optim.Muon's (fast on GPUs); float32 is exact to
# float rounding, and many times faster on CPUs without bfloat16 matmul units (29x on this project's CI CPU).
NS_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass
class MuonTiming:
    """Seconds an optimizer step spent in Newton-Schulz and in the gathers around it, since the last `reset`."""

    step_s: float = 0.0
    newton_schulz_s: float = 0.0
    gather_s: float = 0.0
    scatter_s: float = 0.0
    matrices: int = 0
    gathered_bytes: int = 0

    def reset(self) -> None:
        self.step_s = self.newton_schulz_s = self.gather_s = self.scatter_s = 0.0
        self.matrices = self.gathered_bytes = 0


def newton_schulz(
    g: torch.Tensor,
    coefficients: tuple[float, float, float],
    steps: int,
    eps: float,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """The approximate orthogonalisation of one matrix, in `dtype` (bfloat16: torch.optim.Muon's), with
    torch.optim.Muon's arithmetic.

    X = G / max(||G||_F, eps), transposed to be wide; then `steps` times A = X X^T,
    X = a X + (b A + c A^2) X; transposed back.
    """
    if len(coefficients) != 3:
        raise ParallelConfigError(
            f"muon: ns_coefficients must be three numbers (a, b, c), not {coefficients}"
        )
    a, b, c = coefficients
    x = g.to(dtype=dtype, copy=True)
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if tall else x


def adjusted_lr(lr: float, adjust_lr_fn: str, rows: int, cols: int) -> float:
    """The learning rate of one matrix's orthogonal update: `original` scales by sqrt(max(1, rows/cols))
    (Keller Jordan), `match_rms_adamw` by 0.2 sqrt(max(rows, cols)) (Moonshot: the update's RMS then
    matches AdamW's, so AdamW's lr and weight decay carry over)."""
    if adjust_lr_fn == "original":
        return lr * math.sqrt(max(1.0, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    raise ParallelConfigError(
        f"muon: adjust_lr_fn={adjust_lr_fn!r} is unknown; choose one of {list(ADJUST_LR_FNS)}"
    )


def _holds_whole_matrices(t: DTensor, stacked: int) -> bool:
    """Whether every placement leaves the last two dims whole (it shards only stacking dims, or replicates)."""
    return all(isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim < stacked) for p in t.placements)


class Muon(torch.optim.Optimizer):
    """Muon on the groups marked `muon`, AdamW on the others; parameters may be DTensors of any layout.

    Muon group keys (torch.optim.Muon's names): lr, weight_decay, momentum, nesterov, ns_coefficients,
    ns_steps, eps, adjust_lr_fn, and `stacked` and `ns_dtype` (a name in NS_DTYPES; bfloat16 if absent). AdamW group keys: lr, betas, eps, weight_decay.
    `timing` holds the seconds of the last steps, for the trainer's log line.
    """

    def __init__(self, param_groups: list[dict]):
        for group in param_groups:
            if group.get("muon"):
                stacked = group.get("stacked", 0)
                for p in group["params"]:
                    if p.ndim != stacked + 2:
                        raise ParallelConfigError(
                            f"muon: a parameter of shape {tuple(p.shape)} is in a group of matrices stacked "
                            f"{stacked} deep; it must have {stacked + 2} dims"
                        )
                if group.get("adjust_lr_fn", "original") not in ADJUST_LR_FNS:
                    raise ParallelConfigError(
                        f"muon: adjust_lr_fn={group['adjust_lr_fn']!r} is unknown; choose one of {list(ADJUST_LR_FNS)}"
                    )
                if group.get("ns_dtype", "bfloat16") not in NS_DTYPES:
                    raise ParallelConfigError(
                        f"muon: ns_dtype={group['ns_dtype']!r} is unknown; choose one of {list(NS_DTYPES)}"
                    )
        super().__init__(param_groups, {})
        self.timing = MuonTiming()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        start = time.perf_counter()
        for group in self.param_groups:
            if group["muon"]:
                self._muon_group(group)
            else:
                self._adamw_group(group)
        _sync(self.param_groups)
        self.timing.step_s += time.perf_counter() - start
        return loss

    def _adamw_group(self, group: dict) -> None:
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        beta1, beta2 = group["betas"]
        adam(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            [],
            steps,
            foreach=False,
            decoupled_weight_decay=True,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )

    def _muon_group(self, group: dict) -> None:
        momentum = group["momentum"]
        # Matrices whole on this rank step here, one at a time; split ones are shared out per mesh.
        split: dict[object, list[torch.Tensor]] = {}
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
            state["momentum_buffer"].lerp_(p.grad, 1 - momentum)
            if isinstance(p, DTensor) and not _holds_whole_matrices(p, group["stacked"]):
                split.setdefault(p.device_mesh, []).append(p)
            else:
                _apply(p, self._orthogonalised_here(self._update(p, group), group), group)
        for params in split.values():
            self._step_shared(params, group)

    def _update(self, p: torch.Tensor, group: dict) -> torch.Tensor:
        """What is orthogonalised: the momentum, or its Nesterov look-ahead."""
        buf = self.state[p]["momentum_buffer"]
        return p.grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf

    def _newton_schulz_each(self, whole: torch.Tensor, group: dict) -> torch.Tensor:
        """Newton-Schulz of every matrix of a whole (possibly stacked) tensor, timed."""
        start = time.perf_counter()
        matrices = whole.reshape(-1, *whole.shape[-2:])
        out = torch.empty_like(matrices)
        for i in range(matrices.shape[0]):
            out[i] = newton_schulz(
                matrices[i],
                group["ns_coefficients"],
                group["ns_steps"],
                group["eps"],
                NS_DTYPES[group.get("ns_dtype", "bfloat16")],
            )
        _sync_tensor(out)
        self.timing.matrices += matrices.shape[0]
        self.timing.newton_schulz_s += time.perf_counter() - start
        return out.view(whole.shape)

    def _orthogonalised_here(self, update: torch.Tensor, group: dict) -> torch.Tensor:
        """A plain tensor, or a DTensor whose every matrix is whole on this rank: no communication."""
        if not isinstance(update, DTensor):
            return self._newton_schulz_each(update, group)
        out = self._newton_schulz_each(update.to_local(), group)
        return DTensor.from_local(
            out,
            update.device_mesh,
            update.placements,
            run_check=False,
            shape=update.shape,
            stride=update.stride(),
        )

    def _step_shared(self, params: list[DTensor], group: dict) -> None:
        """Steps the matrices of one mesh, each split across its ranks, each orthogonalised whole once.

        In rounds of as many matrices as the mesh has ranks (largest first, so a round's matrices are
        alike in size): each update is gathered whole (an all-gather), the rank it falls to runs
        Newton-Schulz on it and scatters the result back to every rank's part of the parameter's layout.
        On a GPU the next round's gathers are issued, asynchronously, before this round's Newton-Schulz, so
        they run under it (NCCL on its own stream). On CPU each gather completes before the next matrix's
        update is computed: gloo's threads share the cores Newton-Schulz runs on, so there is nothing to
        hide, and a gather left in flight over other work on the same group crashed ranks under CI's load
        (SIGSEGV over the scatters in the 4-rank Muon rows; SIGABRT over the next update's `lerp` in the
        2-rank ones). Each rank orthogonalises one matrix of a round: 1/ranks of one process's work.
        """
        mesh = params[0].device_mesh
        ranks = mesh.size()
        # Every rank's coordinates, in the same order on all (plain ints: the dry run traces on fake tensors).
        coordinates = list(itertools.product(*(range(n) for n in mesh.shape)))
        me = coordinates.index(tuple(mesh.get_coordinate()))
        order = sorted(params, key=lambda p: -p.numel())
        rounds = [order[k : k + ranks] for k in range(0, len(order), ranks)]
        replicate = [Replicate()] * mesh.ndim

        ahead = params[0].device.type == "cuda"

        def gather(round_: list[DTensor]) -> list[torch.Tensor]:
            start = time.perf_counter()
            issued = [
                self._update(p, group).redistribute(mesh, replicate, async_op=ahead).to_local()
                for p in round_
            ]
            self.timing.gather_s += time.perf_counter() - start
            return issued

        pending = gather(rounds[0]) if ahead else []
        for r, round_ in enumerate(rounds):
            issued = pending if ahead else gather(round_)
            pending = gather(rounds[r + 1]) if ahead and r + 1 < len(rounds) else []
            start = time.perf_counter()
            wholes = [_wait(t) for t in issued]
            _sync_tensor(wholes[0])
            self.timing.gather_s += time.perf_counter() - start
            self.timing.gathered_bytes += sum(w.numel() * w.element_size() for w in wholes)
            outs = [
                self._newton_schulz_each(w, group) if owner == me else torch.empty_like(w)
                for owner, w in enumerate(wholes)
            ]
            del wholes
            start = time.perf_counter()
            results = [
                _scatter_from(out, p, coordinates[owner])
                for owner, (p, out) in enumerate(zip(round_, outs, strict=True))
            ]
            _sync_tensor(outs[0])
            self.timing.scatter_s += time.perf_counter() - start
            for p, update in zip(round_, results, strict=True):
                _apply(p, update, group)


def _apply(p: torch.Tensor, orthogonal: torch.Tensor, group: dict) -> None:
    """Decoupled weight decay, then the orthogonalised update at its matrix's learning rate."""
    lr = group["lr"]
    rows, cols = p.shape[-2:]
    p.mul_(1 - lr * group["weight_decay"])
    p.add_(orthogonal, alpha=-adjusted_lr(lr, group["adjust_lr_fn"], rows, cols))


def _wait(t: torch.Tensor) -> torch.Tensor:
    """The data of an asynchronous collective's result, once it has arrived."""
    return t.wait() if isinstance(t, AsyncCollectiveTensor) else t


def _scatter_from(whole: torch.Tensor, like: DTensor, owner: tuple[int, ...]) -> DTensor:
    """`whole`, valid on the rank at mesh coordinate `owner`, laid out as `like` on every rank.

    Mesh dim by mesh dim, a scatter (Shard) or broadcast (Replicate) from the owner's coordinate on that dim:
    after dim d, every rank whose coordinates past d are the owner's holds its part, so the last dim
    leaves every rank with its own (the order `distribute_tensor` shards in, from any source rank).
    """
    mesh, local = like.device_mesh, whole.contiguous()
    for d, placement in enumerate(like.placements):
        if isinstance(placement, Replicate):
            local = Replicate._make_replicate_tensor(local, mesh, d, owner[d])
        elif isinstance(placement, (Shard, _StridedShard)):
            local = placement._shard_tensor(local, mesh, d, owner[d])
        else:
            raise ParallelConfigError(f"muon: cannot lay out an update as {like.placements}")
    return DTensor.from_local(
        local, mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
    )


def _sync_tensor(t: torch.Tensor) -> None:
    """Wait for `t`'s device, so the host's clock measures the work and not its queueing (CUDA only)."""
    if t.device.type == "cuda":
        torch.cuda.synchronize(t.device)


def _sync(groups: list[dict]) -> None:
    for group in groups:
        for p in group["params"]:
            _sync_tensor(p)
            return


def muon_param_groups(model: nn.Module, muon: dict, adamw: dict) -> list[dict]:
    """Parameter groups for `Muon`: the model's hidden matrices (`HasHiddenMatrices`), grouped by how
    deep they are stacked, with the `muon` settings; every other trainable parameter with the `adamw` ones.

    Frozen parameters get no group. Names are those of `model.named_parameters()`.
    """
    if not isinstance(model, HasHiddenMatrices):
        raise ModelDescriptionError(
            f"muon: {type(model).__name__} does not say which of its parameters are hidden matrices "
            "(hidden_matrices(), titan_parallel.HasHiddenMatrices); use optimizer.name = 'AdamW'"
        )
    matrices = model.hidden_matrices()
    by_depth: dict[int, list[nn.Parameter]] = {}
    rest: list[nn.Parameter] = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if name in matrices:
            by_depth.setdefault(matrices[name], []).append(p)
        else:
            rest.append(p)
    groups = [{"params": ps, "muon": True, "stacked": d, **muon} for d, ps in sorted(by_depth.items())]
    if rest:
        groups.append({"params": rest, "muon": False, **adamw})
    return groups
