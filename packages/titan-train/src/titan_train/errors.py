"""The one error type titan-train raises for a configuration a user must fix."""


class ConfigError(ValueError):
    """A bad config key, value or combination; the message names it and the fix."""
