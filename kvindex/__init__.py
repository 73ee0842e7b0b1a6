"""kvindex, the program: the command line, its config and the wiring of its processes.

The only package that imports :mod:`indexer`, :mod:`api` and :mod:`producer`
together; each of those stands without it.
"""


def __getattr__(name: str) -> str:
    """``__version__`` on first use: importlib.metadata costs a command's start-up
    tens of milliseconds, and only ``--version`` needs it."""
    if name != "__version__":
        raise AttributeError(f"module 'kvindex' has no attribute {name!r}")
    from importlib.metadata import version

    return version("kvindex")
