"""The read path: what a prefix-match query is answered from, and how.

A query (:class:`Query`: a block-hash chain, or a prompt's tokens as each engine's
server renders them) is matched across the selected engines: each engine's chain
computed once per distinct hasher or walked through the learned token index, looked
up in the store once per chain, extended by the routed entries, and, for
``route: "best"``, handed to a ``Picker`` (:class:`LoadAwarePicker` weighs each rank's
prefix against its load). The answer is :mod:`answers`' types,
which the API only encodes; what cannot be answered raises :class:`QueryRefused`.
This is the package's public surface: the API imports nothing below it.
"""

from indexer.query.chains import DECLARED, Overrides, Prompt, Query, learned
from indexer.query.errors import QueryRefused
from indexer.query.matcher import Picked, Picker, ReadPath
from indexer.query.picking import LoadAwarePicker

__all__ = [
    "DECLARED",
    "LoadAwarePicker",
    "Overrides",
    "Picked",
    "Picker",
    "Prompt",
    "Query",
    "QueryRefused",
    "ReadPath",
    "learned",
]
