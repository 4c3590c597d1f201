"""The failures longctx reports to a person as one sentence, without a traceback.

Every error a user can cause or fix (a bad config, data file, checkpoint directory or workdir; a
run stopped for a non-finite loss; a save that could not be written) is a `LongctxError` whose
message names the file, key or step and what to do. Entry points print `longctx: <message>` and
exit non-zero; a traceback is shown only with `--verbose` or `LONGCTX_DEBUG=1`.
"""


class LongctxError(Exception):
    """A failure with a message meant for the user; scripts print it as one line."""


class ConfigError(LongctxError, ValueError):
    """Input that cannot run (config, data, checkpoint directory, workdir, mesh); names the key."""


class RunError(LongctxError):
    """A run that started and had to stop (non-finite loss, a save that failed); names the step."""


class MissingFileError(ConfigError, FileNotFoundError):
    """A file or directory the input names does not exist (also a FileNotFoundError)."""
