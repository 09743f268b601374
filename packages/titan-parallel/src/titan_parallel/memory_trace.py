"""Live tensor bytes over a training step, on real or fake tensors, with what each byte is for.

A `MemoryTrace` is a torch dispatch mode: every tensor an op returns has its storage noted (bytes,
the phase and block running, what kind of op made it) and a weak reference tells when it dies.
`UntypedStorage.resize_` is followed too, since FSDP2 frees and re-allocates its gathered parameters
that way. Under torch's `FakeTensorMode` the same step costs no memory and no compute, so a layout
of 512 GPUs is traced on a CPU, one rank at a time. Nothing here knows a model: blocks come from
the caller, and roles (parameters, gradients, optimizer state) are named by the caller at the end.
What one piece of the step allocated (a span) can be captured and emitted again where the piece
repeats, without running it (`titan_parallel.pipeline_replay`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch
from torch import nn
from torch._guards import active_fake_mode
from torch._subclasses.fake_tensor import DataDependentOutputException
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

CATEGORIES = (
    "parameters",
    "gathered parameters",
    "gradients",
    "optimizer state",
    "activations",
    "loss and logits",
    "backward temporaries",
    "communication buffers",
    "float8",
    "other",
)
_FLOAT8 = {torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz}
# FSDP2's packed all-gather input/output and reduce-scatter input.
_COMM_OPS = {"fsdp::all_gather_copy_in", "fsdp::chunk_cat"}
_PROPAGATE = "_propagate_tensor_meta_non_cached"  # where DTensor runs ops on fake tensors for shapes
_DEVICE = torch.ops.prim.device.default
_GROUPED_MM = torch.ops.aten._grouped_mm.default

Label = tuple  # ("forward", part, block), ("backward", part, block), ("after forward", part, block), (name,)


@dataclass
class _Record:
    nbytes: int
    kind: str
    stream: int  # 1 for communication buffers and gathered parameters (FSDP's own CUDA streams), else 0
    role: str | None = None
    by_label: bool = False  # its kind comes from the label current when it was made


@dataclass
class Span:
    """The allocation events between two points of a trace, to be emitted again (`MemoryTrace.replay`)."""

    events: list[tuple[int, int, int | None]]  # (key, new size, label index; None: the label when replayed)
    made: dict[int, _Record]  # the storages first allocated in the span
    end_label: int | None  # the label current at its end, None where the span set no label


@dataclass
class PhasePeak:
    """The largest live total while one label was current, and what it was made of then."""

    total: int
    breakdown: dict[str, int]


@dataclass
class TraceResult:
    """Peak live bytes of a traced step, where it happened, its breakdown, and the allocation sequence."""

    peak: int
    label: Label
    breakdown: dict[str, int]
    by_label: dict[Label, PhasePeak]
    # (storage key, new size in bytes) in order; 0 frees. For the caching-allocator model.
    sizes: list[tuple[int, int]] = field(repr=False, default_factory=list)
    streams: dict[int, int] = field(repr=False, default_factory=dict)


def _storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    if isinstance(t, DTensor):
        t = t._local_tensor
    if is_traceable_wrapper_subclass(t) and not isinstance(t, torch._subclasses.FakeTensor):
        try:
            inner, _ = t.__tensor_flatten__()
        except DataDependentOutputException:
            # torchao's float8 FSDP weight asks its precomputed scale for a truth value, which a fake
            # tensor cannot give: its inner tensors are its tensor attributes.
            inner = [name for name, value in vars(t).items() if isinstance(value, torch.Tensor)]
        return [s for name in inner for s in _storages(getattr(t, name))]
    return [t.untyped_storage()]


def _fake_grouped_mm(args: tuple, kwargs: dict) -> torch.Tensor:
    """`torch._grouped_mm` on fake tensors (a mixture of experts' grouped path, forward and backward).

    torch 2.11's shape rule takes only bf16 operands (2.15's takes float32 too): where it refuses another
    float dtype, the output's shape comes from the same call in bf16 and the output is made in the operands'
    dtype, which is what the real kernel allocates.
    """
    try:
        return _GROUPED_MM(*args, **kwargs)
    except RuntimeError:
        dtype = args[0].dtype
        if dtype == torch.bfloat16 or not dtype.is_floating_point:
            raise
        bf16 = [
            a.to(torch.bfloat16) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args
        ]
        return _GROUPED_MM(*bf16, **kwargs).to(dtype)


class MemoryTrace(TorchDispatchMode):
    """Track every storage created inside the mode; `result()` gives the peak and its breakdown.

    Use `track()` for tensors that exist before (parameters, buffers, the batch), `watch_blocks()`
    so allocations carry the block they happen in, `label()` for the other phases, `assign()` after
    the step to name the storages that are parameters, gradients or optimizer state, and
    `start_measuring()` to count the peak from a point on (a second step, once optimizer state exists).
    """

    def __init__(self) -> None:
        super().__init__()
        self._keys = WeakIdKeyDictionary()
        self._refs: dict[int, weakref.ref] = {}
        self._records: dict[int, _Record] = {}
        self._events: list[tuple[int, int, int]] = []  # (key, new size, label index)
        self._labels: list[Label] = [("start",)]
        self._label_index: dict[Label, int] = {("start",): 0}
        self._current = 0
        self._switches: list[int] = []  # how many events there were at each change of label
        self._measure_from = 0
        self._orig_resize = None
        self._hooks: list = []
        self._fake_mode_on_entry = None
        self._propagating = 0
        self._orig_propagate = None

    # -- what the caller tells the trace -------------------------------------------------------

    def label(self, label: Label) -> None:
        """Allocations from now on happen in `label` (a tuple such as ("optimizer",))."""
        if label not in self._label_index:
            self._label_index[label] = len(self._labels)
            self._labels.append(label)
        # A change of label even when `label` is current: what a captured span labels itself (the loss) it
        # replays under its own label, not under the one current where it is replayed.
        self._switches.append(len(self._events))
        self._current = self._label_index[label]

    @contextmanager
    def labelled(self, label: Label):
        """`label` while the block runs, then back to the label before it."""
        before = self._labels[self._current]
        self.label(label)
        try:
            yield
        finally:
            self.label(before)

    def track(self, tensors: Iterable[torch.Tensor], kind: str = "other") -> None:
        """Count tensors that exist already (parameters, buffers, the batch) as live."""
        for t in tensors:
            for st in _storages(t):
                self._note(st, kind)

    def assign(self, role: str, tensors: Iterable[torch.Tensor]) -> None:
        """Name the storages of `tensors` as `role` (one of CATEGORIES), whenever they were made."""
        for t in tensors:
            for st in _storages(t):
                key = self._keys.get(st)
                if key is not None:
                    self._records[key].role = role

    def start_measuring(self) -> None:
        """The peak counts from here: what was allocated before and is still live is included."""
        self._measure_from = len(self._events)

    def watch_blocks(self, part: int, blocks: Iterable[nn.Module]) -> None:
        """Label allocations by the block running, forward and backward, for blocks of model part `part`."""
        for i, block in enumerate(blocks):
            self._hooks += [
                block.register_forward_pre_hook(lambda *_, i=i: self.label(("forward", part, i))),
                block.register_forward_hook(lambda *_, i=i: self.label(("after forward", part, i))),
                block.register_full_backward_pre_hook(lambda *_, i=i: self.label(("backward", part, i))),
            ]

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # -- spans: what a piece of the step allocated, emitted again where that piece repeats ---------

    def key_of(self, t: torch.Tensor) -> int | None:
        """The key of the storage `t` lives on (its local shard's, for a DTensor), if the trace knows it."""
        return self._keys.get(_storages(t)[0])

    def mark(self) -> tuple[int, int, int]:
        """A point of the trace to `capture` a span from."""
        return len(self._events), len(self._switches), len(self._records)

    def capture(self, mark: tuple[int, int, int]) -> Span:
        """The events since `mark`; those before the span's first change of label take the label current
        where the span is replayed, as they took the one current when it ran."""
        start, first_switch, first_key = mark
        switches = self._switches[first_switch:]
        inherit = switches[0] if switches else len(self._events)
        events = [
            (k, s, None if n < inherit else li) for n, (k, s, li) in enumerate(self._events[start:], start)
        ]
        made = {k: replace(self._records[k]) for k, _, _ in events if k >= first_key}
        return Span(events, made, self._current if switches else None)

    def replay(
        self, span: Span, keys: dict[int, int], make: dict[int, Callable[[], torch.Tensor]]
    ) -> dict[int, int]:
        """Emit `span`'s events again, as if the piece of the step it captured ran once more.

        A storage the span made gets a new key or, if it is in `make`, is the storage of the tensor that
        `make[key]()` creates at that point (what the piece hands on: an output, a loss, a gradient). A
        storage made before the span stands for the one `keys` gives. Returns the key each storage of
        the span stands for now.
        """
        start_label, now = self._current, dict(keys)
        for key, size, label in span.events:
            self._switch(start_label if label is None else label)
            if key not in now:
                record = span.made[key]  # a KeyError: the span frees a storage the caller did not bind
                record = replace(record, kind=self._kind_now() if record.by_label else record.kind)
                if key in make:
                    now[key] = self.key_of(make[key]())  # its allocation is traced as it happens
                    self._records[now[key]] = record
                    continue
                now[key] = len(self._records)
                self._records[now[key]] = record
            self._events.append((now[key], size, self._current))
        if span.end_label is not None:
            self._switch(span.end_label)
        return now

    def _switch(self, label_index: int) -> None:
        if label_index != self._current:
            self._switches.append(len(self._events))
            self._current = label_index

    # -- the tracking ----------------------------------------------------------------------------

    def _note(self, st: torch.UntypedStorage, kind: str, by_label: bool = False) -> None:
        if st in self._keys:
            return
        key = len(self._records)
        nbytes = st.nbytes()
        stream = 1 if kind in ("communication buffers", "gathered parameters") else 0
        self._records[key] = _Record(nbytes, kind, stream, by_label=by_label)
        self._keys[st] = key
        self._refs[key] = weakref.ref(st, lambda _, key=key: self._free(key))
        if nbytes:
            self._events.append((key, nbytes, self._current))

    def _free(self, key: int) -> None:
        self._refs.pop(key, None)
        self._events.append((key, 0, self._current))

    def _kind_now(self) -> str:
        label = self._labels[self._current]
        if label[0] in ("loss", "loss backward", "head"):
            return "loss and logits"
        if label[0] in ("forward", "after forward", "start", "forward start"):
            return "activations"
        if label[0] == "backward":
            return "backward temporaries"
        return "other"

    def _resize(self, st: torch.UntypedStorage, size: int) -> None:
        self._orig_resize(st, size)
        key = self._keys.get(st)
        if key is None:
            self._note(st, "gathered parameters")
            return
        # Only FSDP frees and re-allocates a storage in place: its gathered parameters.
        self._records[key].kind, self._records[key].by_label = "gathered parameters", False
        self._records[key].stream = 1
        self._events.append((key, st.nbytes(), self._current))

    def __enter__(self):
        self._orig_resize = torch.UntypedStorage.resize_
        trace = self

        def resize_(st, size):
            trace._resize(st, size)

        torch.UntypedStorage.resize_ = resize_
        self._fake_mode_on_entry = active_fake_mode()
        self._orig_propagate = getattr(ShardingPropagator, _PROPAGATE, None)
        if self._orig_propagate is not None:
            orig = self._orig_propagate

            def propagate(*args, **kwargs):
                trace._propagating += 1
                try:
                    return orig(*args, **kwargs)
                finally:
                    trace._propagating -= 1

            setattr(ShardingPropagator, _PROPAGATE, propagate)
        return super().__enter__()

    def __exit__(self, *args):
        torch.UntypedStorage.resize_ = self._orig_resize
        if self._orig_propagate is not None:
            setattr(ShardingPropagator, _PROPAGATE, self._orig_propagate)
        return super().__exit__(*args)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DEVICE:  # asked of every tensor by the autograd engine and DTensor: allocates nothing
            return func(*args)
        # Let tensor subclasses (DTensor, float8 wrappers) unwrap first: their local ops come back here.
        if any(t is not torch._subclasses.FakeTensor and hasattr(t, "__tensor_flatten__") for t in types):
            return NotImplemented
        if func is torch.ops._c10d_functional.wait_tensor.default and active_fake_mode() is not None:
            return args[0]  # its fake kernel returns a new tensor where the real one returns its input
        if func is _GROUPED_MM and active_fake_mode() is not None:
            out = _fake_grouped_mm(args, kwargs or {})
        else:
            out = func(*args, **(kwargs or {}))
        # DTensor's sharding propagation runs ops on fake tensors to learn output shapes: not memory of
        # the step. It uses a fake mode of its own, or the one active (as in a fake trace).
        if self._propagating or active_fake_mode() is not self._fake_mode_on_entry:
            return out
        name = func._schema.name
        kind = "communication buffers" if name in _COMM_OPS or name.startswith("c10d") else None
        if name == "c10d::recv_":
            # A pipeline stage's receive buffer: the stage allocated it (when depends on the schedule and,
            # in a real run, on its shape inference), a receive fills it.
            for st in (st for t in args[0] for st in _storages(t)):
                key = self._keys.get(st)
                if key is not None:
                    self._records[key].kind, self._records[key].by_label = kind, False
        for t in (out,) if isinstance(out, torch.Tensor) else tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                k = "float8" if t.dtype in _FLOAT8 else kind or self._kind_now()
                for st in _storages(t):
                    self._note(st, k, by_label=k != "float8" and kind is None)
        return out

    # -- the result ------------------------------------------------------------------------------

    def category(self, key: int) -> str:
        r = self._records[key]
        return r.role or r.kind

    def result(self) -> TraceResult:
        """Peak live bytes after `start_measuring()`, its label and breakdown, and each label's own peak."""
        live: dict[int, int] = {}
        by_cat = dict.fromkeys(CATEGORIES, 0)
        total = 0
        peak, peak_label, peak_breakdown = -1, self._labels[self._current], {}
        by_label: dict[Label, PhasePeak] = {}
        cats = {key: self.category(key) for key in self._records}
        for n, (key, size, label_index) in enumerate(self._events):
            delta = size - live.get(key, 0)
            live[key] = size
            total += delta
            by_cat[cats[key]] += delta
            if n < self._measure_from:
                continue
            label = self._labels[label_index]
            phase = by_label.get(label)
            if phase is None or total > phase.total:
                by_label[label] = PhasePeak(total, dict(by_cat))
            if total > peak:
                peak, peak_label, peak_breakdown = total, label, dict(by_cat)
        streams = {key: r.stream for key, r in self._records.items()}
        return TraceResult(
            peak=max(peak, 0),
            label=peak_label,
            breakdown=peak_breakdown or dict(by_cat),
            by_label=by_label,
            sizes=[(k, s) for k, s, _ in self._events],
            streams=streams,
        )


def _block_class(label: Label, blocks: int) -> Label:
    """A block label as its place in the stack (first, middle, last), so traces of different depths line up."""
    if len(label) == 3 and isinstance(label[2], int):
        i = label[2]
        place = "first" if i == 0 else "last" if i == blocks - 1 else "middle"
        return (label[0], label[1], place)
    return label


def _by_class(trace: TraceResult, blocks: int) -> dict[Label, PhasePeak]:
    out: dict[Label, PhasePeak] = {}
    for label, phase in trace.by_label.items():
        key = _block_class(label, blocks)
        if key not in out or phase.total > out[key].total:
            out[key] = phase
    return out


def scale_to_blocks(a: TraceResult, b: TraceResult, blocks_a: int, blocks_b: int, blocks: int) -> TraceResult:
    """The trace of a stack of `blocks` blocks, from traces of `blocks_a` and `blocks_b` blocks per model part.

    Blocks are identical, so every phase's peak (the forward or backward of the first, a middle or the
    last block, the loss, the optimizer step) grows by the same bytes with each added block: each
    phase's peak and breakdown is extended along the line through the two traces, and the largest
    phase is the peak. For blocks that repeat with a period (every N-th block checkpointed), trace
    depths that differ by the period and match `blocks` modulo it.
    """
    pa, pb = _by_class(a, blocks_a), _by_class(b, blocks_b)
    t = (blocks - blocks_a) / (blocks_b - blocks_a)
    best = None
    by_label = {}
    for key in pa.keys() & pb.keys():
        total = round(pa[key].total + t * (pb[key].total - pa[key].total))
        breakdown = {
            c: round(pa[key].breakdown[c] + t * (pb[key].breakdown[c] - pa[key].breakdown[c]))
            for c in pa[key].breakdown
        }
        by_label[key] = PhasePeak(total, breakdown)
        if best is None or total > best[1].total:
            best = (key, by_label[key])
    return TraceResult(peak=best[1].total, label=best[0], breakdown=best[1].breakdown, by_label=by_label)
