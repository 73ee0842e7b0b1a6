"""What the plugin reads from the engine's environment.

The engine's own flags say nothing about kvindex, so everything the plugin
needs beyond vLLM's config comes from ``KVINDEX_*`` variables set where the
engine runs (a pod spec, a systemd unit). Without ``KVINDEX_ANNOUNCE_URL`` the
plugin stays inert: installing the extra alone changes nothing.
"""

from __future__ import annotations

import socket
from pathlib import Path

from pydantic import SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class PluginSettings(BaseSettings):
    """``KVINDEX_ANNOUNCE_URL`` (kvindex's API), ``KVINDEX_ANNOUNCE_TOKEN`` or
    ``KVINDEX_ANNOUNCE_TOKEN_FILE`` (its bearer token: needed to send a hash
    seed), ``KVINDEX_ANNOUNCE_LEASE_SECONDS``, ``KVINDEX_ENGINE_NAME`` (default
    ``HOST:PORT`` of the events endpoint), ``KVINDEX_ENGINE_HOST`` (the address
    kvindex connects to where vLLM binds a wildcard; default this machine's FQDN),
    ``KVINDEX_ENGINE_URL`` (the engine's OpenAI server, ``http://HOST:PORT``, as
    kvindex reaches it: its ``/metrics`` tell kvindex's pick the engine's load; the
    engine core is not told the server's address, so it is given here),
    ``KVINDEX_FILTER_REPORTS`` (default true: kvindex reads the plugin's stream
    without reuse reports, :mod:`producer.vllm_plugin.reports`, published at vLLM's
    event ports + ``KVINDEX_EVENTS_PORT_OFFSET``; false: vLLM's own stream, where
    kvindex caps each GPU block at one reference), ``KVINDEX_SNAPSHOTS``
    (default true: each engine core answers kvindex's snapshot requests, with
    the announce token, at its report-free stream's port +
    ``KVINDEX_SNAPSHOT_PORT_OFFSET``; needs the stream, a token and an engine
    that binds).
    """

    model_config = SettingsConfigDict(env_prefix="KVINDEX_", extra="ignore")

    announce_url: str | None = None
    announce_token: SecretStr | None = None
    announce_token_file: Path | None = None
    announce_lease_seconds: float = 30.0
    engine_name: str | None = None
    engine_host: str | None = None
    engine_url: str | None = None
    filter_reports: bool = True
    events_port_offset: int = 1000
    snapshots: bool = True
    snapshot_port_offset: int = 1000

    def token(self) -> str | None:
        """The bearer token; a file is read at start so a rotated secret is picked up
        on the engine's next restart."""
        if self.announce_token is not None:
            return self.announce_token.get_secret_value()
        if self.announce_token_file is not None:
            return self.announce_token_file.read_text().strip() or None
        return None

    def snapshot_token(self, replay_endpoint: str | None, engine_binds: bool) -> str | None:
        """The token snapshots are served with beside the plugin's report-free stream
        (``replay_endpoint``: that stream's), None where they are not: turned off,
        no replay to follow a snapshot with, kvindex binding the engine's sockets
        (the plugin would bind on kvindex's host), or no token to guard the
        engine's state. The announcement and the server both ask this."""
        if not self.snapshots or replay_endpoint is None or not engine_binds:
            return None
        return self.token()

    def host(self) -> str:
        return self.engine_host or socket.getfqdn()
