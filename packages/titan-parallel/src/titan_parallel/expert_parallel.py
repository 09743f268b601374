"""Expert parallelism: experts sharded over the ep ranks, tokens sent to them and back by all-to-all.

A model's MoE layer (see `protocols.HasMoELayers`) sorts its routed token rows by expert and calls
`experts(rows, num_tokens_per_expert)`. The styles here wrap that call with torch's
`distribute_module`: before it, each rank sends every row to the rank holding its expert
(`all_to_all_single_autograd`, so the backward sends the gradients back the same way) and reorders
what it received so the rows of each local expert are contiguous, as a grouped matmul needs; after
it, the rows go back to where they came from. The experts' weights become DTensors sharded on the
expert dim (Shard(0)) over the ep mesh, and with etp = tp also on the hidden dim over tp.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from titan_parallel.errors import ModelDescriptionError, ParallelConfigError
from titan_parallel.parallel_dims import ParallelDims
from titan_parallel.protocols import HasMoELayers

logger = logging.getLogger(__name__)

EXPERT_WEIGHTS = ("w1", "w2", "w3")
# Tensor-parallel split of one expert's SwiGLU: w1, w3 [E, hidden, dim] by output rows (colwise),
# w2 [E, dim, hidden] by input columns (rowwise), so the hidden activations never move.
_HIDDEN_DIM = {"w1": 1, "w2": 2, "w3": 1}


def hidden_dims(experts: nn.Module) -> dict[str, int | None]:
    """Weight name -> the dim holding the experts' hidden units (None: kept whole over tp), as the
    experts module declares it (`tp_split_dims`), else the SwiGLU's w1/w2/w3."""
    return getattr(experts, "tp_split_dims", _HIDDEN_DIM)


def expert_sizes(experts: nn.Module) -> tuple[int, int]:
    """(number of experts, hidden width of one expert) of an experts module, read from its weights'
    global shapes: dim 0 of every weight, and the hidden dim of the first split one."""
    dims = hidden_dims(experts)
    name = next(n for n, d in dims.items() if d is not None)
    weight = getattr(experts, name)
    hidden = getattr(experts, "hidden_dim", None) or weight.shape[dims[name]]
    return weight.shape[0], hidden


@dataclass(frozen=True)
class Dispatched:
    """What a dispatch hands its combine: how to send the experts' output rows back where they came from.

    `order` put the received rows in expert-major order; `send` and `recv` are the all-to-all's split
    sizes (per ep rank) of the dispatch; `total` and `bounds` place this tp rank's slice of the rows
    (`bounds` None: the rows were not sliced over tp).
    """

    order: torch.Tensor
    send: list[int]
    recv: list[int]
    group: object
    total: int
    bounds: tuple[int, int] | None


class ExpertParallel(ParallelStyle):
    """Shard an experts module on dim 0 over an ep mesh; dispatch rows to it and combine them back.

    `tp_mesh` is given where the experts' input rows are the same on every tensor-parallel rank
    (the MoE layer's input is replicated over tp): with `split_experts_over_tp` (etp = tp) the
    mesh passed to `apply` is (ep, etp) and each expert's hidden dim is split over etp; without
    it (etp = 1, ep borrowing tp ranks) each tp rank sends only its own slice of the rows, and its
    output holds only that slice (the MoE output is then a partial sum over tp, which the model's
    tp_plan reduces). Either way the input rows' gradient is summed over tp in backward.
    `whole_output` sums the output over tp here instead (an all-reduce), for a MoE layer that needs
    its experts' outputs whole on every tp rank (see `protocols.HasMoELayers`).
    """

    def __init__(
        self,
        *,
        tp_mesh: DeviceMesh | None = None,
        split_experts_over_tp: bool = False,
        whole_output: bool = False,
    ):
        super().__init__()
        self.tp_mesh, self.split_experts_over_tp = tp_mesh, split_experts_over_tp
        self.whole_output = whole_output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        distribute_module(module, device_mesh, partition_fn=self._partition)
        # The experts' own forward between dispatch and combine: the handle one hands the other is a
        # local of each call, so nothing is kept on the module or this style between the two.
        module.forward = functools.partial(self._forward, module.forward, device_mesh)
        return module

    def _forward(self, experts_forward, mesh: DeviceMesh, rows: torch.Tensor, counts: torch.Tensor):
        rows, local_counts, handle = self._dispatch(rows, counts, mesh)
        return self._combine(experts_forward(rows, local_counts), handle)

    def _placements(self, module: nn.Module, name: str) -> list:
        if not self.split_experts_over_tp:
            return [Shard(0)]
        hidden = hidden_dims(module)[name]
        return [Shard(0), Replicate() if hidden is None else Shard(hidden)]

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        if name:  # only the experts module's own weights
            return
        for param_name, param in list(module.named_parameters(recurse=False)):
            sharded = distribute_tensor(param, mesh, self._placements(module, param_name))
            module.register_parameter(param_name, nn.Parameter(sharded, requires_grad=param.requires_grad))

    def _ep_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        return mesh["ep"] if self.split_experts_over_tp else mesh

    def _dispatch(
        self, rows: torch.Tensor, counts: torch.Tensor, mesh: DeviceMesh
    ) -> tuple[torch.Tensor, torch.Tensor, Dispatched]:
        """Send every row to the ep rank holding its expert; the received rows in expert-major order, the
        rows per local expert, and the handle `_combine` sends the output back with."""
        counts = counts.to(torch.int64)
        if self.tp_mesh is not None:
            # The rows are replicated over tp, but each tp rank back-propagates only its part.
            rows = DTensor.from_local(rows, self.tp_mesh, (Replicate(),), run_check=False)
            rows = rows.to_local(grad_placements=(Partial(),))
        total, bounds = rows.shape[0], None
        if self.tp_mesh is not None and not self.split_experts_over_tp:
            rows, counts, bounds = _tp_slice(rows, counts, self.tp_mesh)
        ep_mesh = self._ep_mesh(mesh)
        ep, group = ep_mesh.size(), ep_mesh.get_group()
        if is_fake(counts):
            return self._dispatch_traced(rows, counts, ep, group, total, bounds)
        with torch.no_grad():
            received = all_to_all_single(counts, None, None, group=group)
            received = torch.ops._c10d_functional.wait_tensor(received)
            send = counts.view(ep, -1).sum(1).tolist()
            recv = received.view(ep, -1).sum(1).tolist()  # a device-to-host sync: the split sizes
        rows = all_to_all_single_autograd(rows, recv, send, group)
        order, local_counts = expert_major_order(received, ep)
        return rows.index_select(0, order), local_counts, Dispatched(order, send, recv, group, total, bounds)

    def _dispatch_traced(
        self, rows: torch.Tensor, counts: torch.Tensor, ep: int, group, total: int, bounds
    ) -> tuple[torch.Tensor, torch.Tensor, Dispatched]:
        """A dry run's dispatch on fake tensors, which hold no counts to split by: routing taken as
        balanced (every rank sends and receives an equal share of rows), so shapes and memory are those
        of a balanced step."""
        share = [rows.shape[0] // ep] * ep
        share[-1] += rows.shape[0] - sum(share)
        rows = all_to_all_single_autograd(rows, share, share, group)
        order = torch.arange(rows.shape[0], device=rows.device)
        return rows, counts.view(ep, -1).sum(0), Dispatched(order, share, share, group, total, bounds)

    def _combine(self, out: torch.Tensor, handle: Dispatched) -> torch.Tensor:
        """The experts' output rows sent back to the ranks (and tp slice) their inputs came from."""
        out = out.index_select(0, torch.argsort(handle.order))  # back to (source rank, local expert) order
        out = all_to_all_single_autograd(out, handle.send, handle.recv, handle.group)
        if handle.bounds is not None:  # this tp rank's rows in place, zeros for the other tp ranks' rows
            start, end = handle.bounds
            out = F.pad(out, (0, 0, start, handle.total - end))
        if self.whole_output and self.tp_mesh is not None:
            out = sum_over_tp(out, self.tp_mesh)
        return out


class TensorParallelExperts(ParallelStyle):
    """Without ep: split each expert's hidden dim over tp; rows stay put, the output is a partial sum
    (or, with `whole_output`, that sum, all-reduced over tp)."""

    def __init__(self, *, whole_output: bool = False):
        super().__init__()
        self.whole_output = whole_output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        output_fn = (lambda _mod, out, mesh: sum_over_tp(out, mesh)) if self.whole_output else None
        return distribute_module(
            module, device_mesh, partition_fn=self._partition, input_fn=self._prepare, output_fn=output_fn
        )

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        if name:
            return
        for param_name, param in list(module.named_parameters(recurse=False)):
            hidden = hidden_dims(module)[param_name]
            sharded = distribute_tensor(param, mesh, [Replicate() if hidden is None else Shard(hidden)])
            module.register_parameter(param_name, nn.Parameter(sharded, requires_grad=param.requires_grad))

    def _prepare(self, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        rows, counts = inputs
        rows = DTensor.from_local(rows, mesh, (Replicate(),), run_check=False).to_local(
            grad_placements=(Partial(),)
        )
        return rows, counts


def sum_over_tp(out: torch.Tensor, tp_mesh: DeviceMesh) -> torch.Tensor:
    """The whole of an output each tp rank holds a part of, on every tp rank (all-reduce).

    In backward each rank's part gets the whole gradient once (DTensor keeps the gradient of a
    Partial -> Replicate redistribution replicated), not a sum of the ranks' copies.
    """
    partial = DTensor.from_local(out, tp_mesh, (Partial(),), run_check=False)
    return partial.redistribute(tp_mesh, (Replicate(),)).to_local()


def expert_major_order(received: torch.Tensor, ep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Reorder rows grouped by (source rank, local expert) into rows grouped by (local expert, source rank).

    `received[s * L + e]` counts the rows source rank s sent for local expert e, in that order.
    Returns the row order (an index for `index_select`) and the rows per local expert.
    """
    per_source = received.view(ep, -1)
    local = per_source.shape[1]
    group = torch.arange(received.numel(), device=received.device).repeat_interleave(received)
    key = (group % local) * ep + group // local
    return torch.argsort(key, stable=True), per_source.sum(0)


def _tp_slice(
    rows: torch.Tensor, counts: torch.Tensor, tp_mesh: DeviceMesh
) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:
    """This tp rank's contiguous share of the expert-sorted rows, and how many rows each expert has in it."""
    rank, size, total = tp_mesh.get_local_rank(), tp_mesh.size(), rows.shape[0]
    start, end = rank * total // size, (rank + 1) * total // size
    ends = torch.cumsum(counts, 0)
    starts = ends - counts
    mine = (ends.clamp(start, end) - starts.clamp(start, end)).to(counts.dtype)
    return rows[start:end], mine, (start, end)


def moe_layers_of(model: nn.Module) -> dict[str, nn.Module]:
    """The MoE layers a model declares through `moe_layers()`; {} for a model without any."""
    if not isinstance(model, HasMoELayers):
        return {}
    layers = model.moe_layers()
    for fqn, layer in layers.items():
        experts = getattr(layer, "experts", None)
        if experts is None or any(not hasattr(experts, w) for w in hidden_dims(experts)):
            raise ModelDescriptionError(
                f"{type(model).__name__}.moe_layers()['{fqn}'] has no `experts` module with weights "
                f"{tuple(hidden_dims(experts or nn.Module()))}; see titan_parallel.protocols.HasMoELayers"
            )
    return layers


def apply_expert_parallel(model: nn.Module, dims: ParallelDims) -> dict[str, nn.Module]:
    """Split the experts of every MoE layer as `dims` says; returns the experts modules by FQN.

    ep > 1: experts sharded on dim 0 over "ep" with all-to-all dispatch (and over "etp" on the
    hidden dim with etp = tp); ep = 1 and tp > 1: every expert split on its hidden dim over tp.
    Call after `apply_tp` (the model's tp_plan covers the rest of the MoE layer) and before
    checkpointing, compile and FSDP. Works on a meta-device model.
    """
    layers = moe_layers_of(model)
    experts = {f"{fqn}.experts" if fqn else "experts": layer.experts for fqn, layer in layers.items()}
    if not experts or (dims.ep == 1 and dims.tp == 1):
        return experts
    for layer in layers.values():
        module = layer.experts
        n_experts, _ = expert_sizes(module)
        if n_experts % dims.ep:
            raise ParallelConfigError(
                f"parallelism: expert_parallel_degree({dims.ep}) does not divide the model's num_experts "
                f"({n_experts}); each expert-parallel rank holds the same number of whole experts"
            )
        whole = bool(getattr(layer, "tp_output_whole", False))
        if dims.ep > 1:
            style = ExpertParallel(
                tp_mesh=dims.submesh("tp"), split_experts_over_tp=dims.etp > 1, whole_output=whole
            )
            parallelize_module(module, dims.submesh("experts"), style)
        else:
            parallelize_module(module, dims.submesh("tp"), TensorParallelExperts(whole_output=whole))
    logger.info("experts of %d MoE layers: ep %d, etp %d, tp %d", len(experts), dims.ep, dims.etp, dims.tp)
    return experts
