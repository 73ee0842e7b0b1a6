"""Self-registration: announcements, leases, restarts and clean shutdowns.

The API rules run against the app with the real subscriber (engines publish
on local ports); the lease, kill -9 and restart cases run ``kvindex serve`` and
``kvindex sim --announce`` as processes, exactly as a fleet would
(``test_announce_processes.py``).
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator

import pytest

from api import ApiSettings
from indexer.announcements import LeaseRules

from .announce_kit import announcement, spec
from .apikit import LiveApi, engine
from .test_e2e import until

TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
FAST = LeaseRules(min_lease_seconds=0.2, default_lease_seconds=5, sweep_seconds=0.05)


@pytest.fixture
async def live() -> AsyncIterator[LiveApi]:
    async with LiveApi(ApiSettings(announce=FAST)) as api:
        yield api


@pytest.fixture
async def guarded() -> AsyncIterator[LiveApi]:
    async with LiveApi(ApiSettings(announce=FAST, auth_token=TOKEN)) as api:
        yield api


async def test_an_announcement_registers_renews_restarts_and_updates(live):
    body = spec(block_size=32)
    first = await live.client.post("/engines/announce", json=announcement(body))
    assert first.status_code == 200, first.text
    assert first.json() == {
        "name": "e",
        "instance": "i1",
        "lease_seconds": 5.0,
        "outcome": "registered",
    }
    assert [s.name for s in live.registry.all()] == ["e"]
    again = await live.client.post("/engines/announce", json=announcement(body))
    assert again.json()["outcome"] == "renewed"
    restarted = await live.client.post("/engines/announce", json=announcement(body, "i2"))
    assert restarted.json()["outcome"] == "restarted"
    changed = {**body, "block_size": 16}
    updated = await live.client.post("/engines/announce", json=announcement(changed, "i2"))
    assert updated.json()["outcome"] == "updated"
    assert live.registry.get("e").block_size == 16
    state = (await live.client.get("/engines/e")).json()
    assert state["lease"]["instance"] == "i2"
    assert 0 < state["lease"]["expires_in"] <= 5.0


async def test_the_lease_asked_for_is_clamped_to_the_configured_bounds(live):
    short = await live.client.post(
        "/engines/announce", json=announcement(spec("a"), lease_seconds=0.01)
    )
    long = await live.client.post(
        "/engines/announce", json=announcement(spec("b"), lease_seconds=1e9)
    )
    assert (short.json()["lease_seconds"], long.json()["lease_seconds"]) == (0.2, 300.0)


async def test_a_lapsed_lease_drops_the_engine_and_its_residency(live):
    from indexer import metrics

    expired = metrics.LEASES_EXPIRED._value.get()
    (publisher,) = await live.add_published("hand")  # hand-registered: never expires
    await live.client.post("/engines/announce", json=announcement(spec("e"), lease_seconds=0.2))
    await until(
        lambda: _names(live, {"hand"}), timeout=5, what="the announced engine to be dropped"
    )
    assert metrics.LEASES_EXPIRED._value.get() == expired + 1
    assert (await live.client.get("/engines/e")).status_code == 404
    assert (await live.client.get("/engines/hand")).json()["lease"] is None
    publisher.close()


async def _names(live: LiveApi, expected: set[str]) -> bool:
    return {s.name for s in live.registry.all()} == expected


async def test_a_new_spec_the_subscriber_refuses_leaves_the_old_registration(live):
    body = spec()
    await live.client.post("/engines/announce", json=announcement(body))
    with socket.socket() as taken:  # the subscriber must bind this port, but it is taken
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        bad = {**body, "endpoint": f"tcp://127.0.0.1:{taken.getsockname()[1]}", "bind": True}
        refused = await live.client.post("/engines/announce", json=announcement(bad))
    assert refused.status_code == 422, refused.text
    assert "cannot consume engine 'e'" in refused.json()["error"]
    assert live.registry.get("e").endpoint == body["endpoint"]
    renewed = await live.client.post("/engines/announce", json=announcement(body))
    assert renewed.json()["outcome"] == "renewed"


async def test_deregistration_is_immediate_and_refuses_a_stale_instance(live):
    await live.client.post("/engines/announce", json=announcement(spec(), "new"))
    stale = await live.client.delete("/engines/announce/e", params={"instance": "old"})
    assert stale.status_code == 409 and "'new'" in stale.json()["error"]
    assert [s.name for s in live.registry.all()] == ["e"]
    gone = await live.client.delete("/engines/announce/e", params={"instance": "new"})
    assert gone.json()["outcome"] == "deregistered"
    assert live.registry.all() == []
    unknown = await live.client.delete("/engines/announce/e", params={"instance": "new"})
    assert unknown.status_code == 404


async def test_a_leased_engine_removed_by_hand_is_registered_again_by_its_renewal(live):
    await live.client.post("/engines/announce", json=announcement(spec()))
    assert (await live.client.delete("/engines/e")).status_code == 200
    again = await live.client.post("/engines/announce", json=announcement(spec()))
    assert again.json()["outcome"] == "registered"
    assert [s.name for s in live.registry.all()] == ["e"]


async def test_a_hand_registered_engine_is_not_taken_over(live):
    await live.registry.add(engine("hand"))
    took = await live.client.post("/engines/announce", json=announcement(spec("hand")))
    removed = await live.client.delete("/engines/announce/hand", params={"instance": "i1"})
    assert (took.status_code, removed.status_code) == (409, 409)
    assert "by hand" in took.json()["error"]
    assert live.registry.get("hand").endpoint == "tcp://127.0.0.1:1"


async def test_a_hash_seed_needs_an_authenticated_request(live, guarded):
    seeded = announcement(spec(hash_algo="xxhash", hash_seed="42"))
    refused = await live.client.post("/engines/announce", json=seeded)
    assert refused.status_code == 403 and "spec.hash_seed" in refused.json()["error"]
    assert live.registry.all() == []
    # Saying a seed is in force without sending it: kvindex matches it as learned.
    unsent = announcement(spec(hash_algo="xxhash"), seeded=True)
    assert (await live.client.post("/engines/announce", json=unsent)).status_code == 200
    assert live.registry.get("e").hash_algo is None

    no_token = await guarded.client.post("/engines/announce", json=seeded)
    assert no_token.status_code == 401
    taken = await guarded.client.post("/engines/announce", json=seeded, headers=AUTH)
    assert taken.status_code == 200, taken.text
    assert (guarded.registry.get("e").hash_algo, guarded.registry.get("e").hash_seed) == (
        "xxhash",
        "42",
    )
    anonymous = await guarded.client.delete("/engines/announce/e", params={"instance": "i1"})
    assert anonymous.status_code == 401


async def test_malformed_announcements_name_the_field(live):
    cases = {
        "instance": announcement(spec(), ""),
        "lease_seconds": announcement(spec(), lease_seconds=-1),
        "spec.block_size": announcement(spec(block_size=0)),
        "colour": {**announcement(spec()), "colour": "red"},
    }
    for field, body in cases.items():
        answer = await live.client.post("/engines/announce", json=body)
        assert answer.status_code == 422, (field, answer.text)
        assert field.split(".")[-1] in answer.json()["error"], (field, answer.text)
    assert live.registry.all() == []
