"""kvindex, the program: the command line, its config and the wiring of its processes.

The only package that imports :mod:`indexer`, :mod:`api` and :mod:`producer`
together; each of those stands without it.
"""

from importlib.metadata import version

__version__ = version("kvindex")
