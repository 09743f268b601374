"""The one error type titan-ckpt raises for a checkpoint a user must fix or move."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded or written; the message names the folder, file or key."""
