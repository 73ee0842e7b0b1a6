"""What kvindex's guarded protocol (``kvindex/h11_guard.py``) takes from uvicorn's private
``H11Protocol``: the methods it overrides, with the arguments uvicorn calls them with, and
the attributes it reads. An upgrade of uvicorn that moves any of them fails here, by name,
rather than as a guard that silently stops guarding (``tests/test_http_heads.py`` checks
what the guards do, through a real server)."""

from __future__ import annotations

import inspect

import h11
import pytest
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

from kvindex.h11_guard import GuardedH11Protocol, HeadBudget

#: each method the guard overrides and the parameters it is called with: by asyncio (the
#: ``connection_*`` and ``data_received`` callbacks), or by uvicorn's own code
OVERRIDDEN = {
    "connection_made": ["transport"],
    "data_received": ["data"],
    "send_400_response": ["msg"],
    "on_response_complete": [],
    "connection_lost": ["exc"],
}


@pytest.mark.parametrize(("method", "parameters"), OVERRIDDEN.items())
def test_uvicorn_calls_what_the_guard_overrides_as_it_expects(method: str, parameters) -> None:
    assert method in vars(GuardedH11Protocol), f"the guard no longer overrides {method}"
    uvicorns = inspect.signature(getattr(H11Protocol, method))
    assert list(uvicorns.parameters)[1:] == parameters, f"uvicorn's {method}{uvicorns}"
    if method in ("send_400_response", "on_response_complete"):  # uvicorn's own calls
        source = inspect.getsource(inspect.getmodule(H11Protocol))
        assert f"self.{method}" in source, f"uvicorn no longer calls {method}"


async def test_a_guarded_protocol_has_the_state_it_reads_from_uvicorn() -> None:
    async def app(scope, receive, send) -> None:  # never called
        raise AssertionError

    config = uvicorn.Config(app, h11_max_incomplete_event_size=1 << 20)
    state = ServerState()
    protocol = GuardedH11Protocol(
        config,
        state,
        {},
        head_timeout=1.0,
        heads=HeadBudget(1 << 20),
        max_connections=4,
        max_head=1 << 20,
    )
    assert protocol.connections is state.connections and protocol.tasks is state.tasks
    assert isinstance(protocol.conn, h11.Connection)
    assert protocol.conn.their_state is h11.IDLE
    assert protocol.conn.trailing_data == (b"", False)
    assert callable(protocol.app) and protocol.loop is not None
