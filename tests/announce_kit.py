"""The bodies an engine announces itself with, built one way for the API rules
and the process tests alike, so both ask kvindex the same questions."""

from __future__ import annotations

from .conftest import free_ports


def spec(name: str = "e", **fields) -> dict:
    return {"name": name, "endpoint": f"tcp://127.0.0.1:{free_ports()}", **fields}


def announcement(body: dict, instance: str = "i1", **fields) -> dict:
    return {"spec": body, "instance": instance, **fields}
