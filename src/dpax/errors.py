"""The one exception type for input a user can fix.

The CLI turns a `DpaxError` into a single stderr line and exit code 2; anything
else is a bug and keeps its traceback.
"""


class DpaxError(ValueError):
    """Bad input or environment; the message names the problem and the fix."""
