"""Errors caused by the user's input: the CLI prints their one-line message and exits non-zero."""


class UserError(Exception):
    """A mistake the user can fix (bad config, missing file); shown without a traceback."""


class ConfigError(UserError):
    """An invalid configuration key or value."""
