"""The one error type titan-parallel raises for a layout or input a user must change, and the check of a choice."""


class ParallelConfigError(ValueError):
    """A parallel layout that cannot run; the message names the numbers and the fix."""


class ModelDescriptionError(ParallelConfigError, TypeError):
    """A model lacks the description (blocks, TP plan, pipeline units) a parallelism needs."""


class UnsupportedDeviceError(ParallelConfigError):
    """A feature this device cannot run; the message says what is missing and where it runs."""


def check_choice(field: str, value: object, allowed: tuple[str, ...]) -> None:
    """Refuse a setting outside its choices, naming the field (`group.field`) and listing them."""
    if value not in allowed:
        raise ParallelConfigError(f"parallelism: {field}={value!r} is unknown; choose one of {list(allowed)}")
