"""Exceptions raised by recfuse."""


class RecfuseError(RuntimeError):
    """A model or input recfuse cannot handle, with the reason in the message.

    Example:
        >>> import recfuse
        >>> try:
        ...     recfuse.transform(lambda x: x if x.sum() > 0 else -x)
        ... except recfuse.RecfuseError as e:
        ...     print("cannot capture:", str(e)[:20])  # doctest: +SKIP
    """
