"""The one exception type that means "the user asked for something wrong"."""


class UsageError(ValueError):
    """A bad setting from the user: the message names the value, the choices and the fix.

    `train.py` prints it as one line and exits non-zero, without a traceback.
    """
