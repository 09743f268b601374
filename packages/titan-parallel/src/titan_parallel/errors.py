"""The one error type titan-parallel raises for a layout or input a user must change."""


class ParallelConfigError(ValueError):
    """A parallel layout that cannot run; the message names the numbers and the fix."""
