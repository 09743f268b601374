"""The one error type titan-data raises for input a user must fix."""


class DataError(ValueError):
    """A missing tokenizer, an unknown or empty dataset, or another data input that cannot work."""


class SourceUnavailable(DataError):
    """A remote source stopped answering mid-run and retries did not bring it back.

    Unlike other `DataError`s it says nothing is wrong with the input: the same run can go on once the
    source answers again, so a trainer saves and stops with a retryable status instead of failing.
    """
