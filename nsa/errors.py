"""Errors caused by the user's input: the CLI prints their one-line message and exits non-zero."""


class UserError(Exception):
    """A mistake the user can fix (bad config, missing file); shown without a traceback."""


class ConfigError(UserError):
    """An invalid configuration key or value."""


class Interrupted(UserError):
    """The run stopped on a signal after saving a checkpoint: the CLI prints the message (on the rank that
    should) and exits with `exit_code`, the shell's 128 + signal number."""

    def __init__(self, message: str, exit_code: int, show: bool = True):
        super().__init__(message)
        self.exit_code, self.show = exit_code, show
