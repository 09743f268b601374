"""The one error type titan-data raises for input a user must fix."""


class DataError(ValueError):
    """A missing tokenizer, an unknown or empty dataset, or another data input that cannot work."""
