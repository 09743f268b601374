"""What generic titan-train code may ask of a family's args: typed protocols, each with the answer a family
that does not declare it gets. A family states these on its args class (titan-models); nothing here
names a family, and no generic module reads a family's field by name."""

from __future__ import annotations

from typing import Any, ClassVar, Protocol, runtime_checkable


@runtime_checkable
class HasExperts(Protocol):
    """MoE families keep their `MoEArgs` in `moe_args` (None for a dense flavor of the family)."""

    moe_args: Any


@runtime_checkable
class RefusesContextParallel(Protocol):
    """Why context parallelism cannot split this flavor's attention, or None where it can."""

    @property
    def context_parallel_refusal(self) -> str | None: ...


@runtime_checkable
class RotatesItsOwnAttention(Protocol):
    """A family that computes its own attention under context parallelism names the rotate methods it honours."""

    context_parallel_rotate_methods: ClassVar[tuple[str, ...]]


@runtime_checkable
class KeepsPositionFunction(Protocol):
    """A family whose rotary function depends on the table's length (YaRN) resizes it itself."""

    def with_positions(self, positions: int) -> Any: ...


@runtime_checkable
class NamesNormEpsilons(Protocol):
    """The args fields that hold a norm epsilon (a published checkpoint may state its own)."""

    norm_epsilon_fields: ClassVar[tuple[str, ...]]


def moe_args_of(args: Any) -> Any:
    """The family's MoEArgs, or None for a model without experts."""
    return args.moe_args if isinstance(args, HasExperts) else None


def context_parallel_refusal(args: Any) -> str | None:
    return args.context_parallel_refusal if isinstance(args, RefusesContextParallel) else None


def context_parallel_rotate_methods(args: Any) -> tuple[str, ...] | None:
    return args.context_parallel_rotate_methods if isinstance(args, RotatesItsOwnAttention) else None


def norm_epsilon_fields(args: Any) -> tuple[str, ...]:
    return args.norm_epsilon_fields if isinstance(args, NamesNormEpsilons) else ("norm_eps",)
