"""The one exception type the CLI turns into a one-line message and exit code 1."""


class DimdError(Exception):
    """A user-facing error: bad input, a missing file, a mismatch.

    The message names the file (or option) and the problem, in one line, so a
    user can act on it without a traceback.
    """
