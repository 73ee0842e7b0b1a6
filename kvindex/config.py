"""The config file of ``kvindex serve``, ``kvindex indexer`` and ``kvindex api``.

Each command reads the sections it needs (:mod:`kvindex.serve`,
:mod:`kvindex.processes`). YAML, or TOML by its ``.toml`` suffix::

    engines:                      # EngineSpec fields, see indexer.engine_registry
      - name: vllm-a
        endpoint: tcp://10.0.0.5:5557
        replay_endpoint: tcp://10.0.0.5:5558
        dp_ranks: 2
        blocks_per_chunk: 16
    engine_urls:                  # engines their OpenAI server describes, see
      - http://10.0.0.6:8100      # indexer.discovery.served (URL[,FIELD=VALUE...])
      - {url: http://10.0.0.7:8100, name: vllm-b, hash_algo: sha256_cbor}
    discover:                     # engines found by DNS or Kubernetes, see indexer.discovery
      - dns://vllm.default.svc.cluster.local:5557?replay_port=5558
    subscriber:                   # SubscriberSettings, see indexer.ingest.subscriber
      replay_timeout: 2.0
      gap_clear_threshold: 1000
      bind:                       # BindPolicy: where engines with bind: true may
        ipc_dir: /run/kvindex     # make kvindex listen (default: loopback tcp only)
    api:                          # ApiSettings, see api.settings
      auth_token_file: /run/secrets/kvindex-token   # or auth_token, $KVINDEX_AUTH_TOKEN
    redis:                        # RedisConfig, see indexer.stores.redis
      url: redis://127.0.0.1:6379/0
      cluster: false
    indexer:                      # WorkerSettings, see indexer.cluster.workers
      lease_ttl: 6.0
    metrics:                      # MetricsSettings, see indexer.metrics
      rank_series: 100            # ranks with gauges of their own (the rest: per engine)
    models:                       # ModelTokenizer, see indexer.prompts: for prompt/messages
      llama-3-8b:                 # queries naming this model (pip install 'kvindex[tokenize]')
        tokenizer: /models/llama-3-8b     # a directory or a hub id
        chat_template: /etc/kvindex/llama3.jinja   # optional: overrides the tokenizer's
        adapter: vllm             # optional: the engine whose server's rendering applies
        enable_auto_tool_choice: true   # optional: the server's tool flags (vllm serve's
        tool_call_parser: hermes        # --enable-auto-tool-choice, --tool-call-parser and
        exclude_tools_when_tool_choice_none: false   # --exclude-tools-when-tool-choice-none)

A ``KVINDEX_<SECTION>__<FIELD>`` variable overrides the file's field
(``KVINDEX_SUBSCRIBER__REPLAY_TIMEOUT=2``; :func:`load_config`), so a container
can be configured without a file. The API's auth token comes from a flag, the
environment or this file
(:func:`resolve_auth_token`); a listener other machines can reach without one
is refused (:func:`refuse_open_door`).
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, get_origin

import msgspec
import pydantic
import yaml
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from api.settings import ApiSettings
from indexer.cluster.workers import WorkerSettings
from indexer.discovery import Source, open_source
from indexer.discovery.served import EngineUrl, engine_url, parse_engine_url
from indexer.engine_registry import BindRefused, EngineSpec, is_loopback
from indexer.ingest.subscriber import SubscriberSettings
from indexer.metrics import MetricsSettings
from indexer.prompts import EXTRA, INSTALL, ModelTokenizer, missing_extra
from indexer.stores.redis import RedisConfig
from kvindex.options import ENV_PREFIX


class ConfigError(ValueError):
    """The config file cannot be used; the message says where and why."""


class OpenDoor(ConfigError):
    """The API would let anyone who reaches it register engines: refused at start."""


#: The environment variable holding the API's bearer token.
AUTH_TOKEN_ENV = "KVINDEX_AUTH_TOKEN"


class ServeConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The ``--config`` file."""

    engines: list[EngineSpec] = []
    #: engines given by their OpenAI server's URL: ``URL[,FIELD=VALUE...]`` or
    #: ``{url: URL, FIELD: VALUE...}``, see indexer.discovery.served
    engine_urls: list[str | dict[str, Any]] = []
    #: ``--discover`` URLs (dns://NAME:PORT?..., k8s://NAMESPACE?...), see indexer.discovery
    discover: list[str] = []
    subscriber: SubscriberSettings = SubscriberSettings()
    api: dict[str, Any] = {}
    redis: dict[str, Any] | None = None
    indexer: WorkerSettings = WorkerSettings()
    metrics: MetricsSettings = MetricsSettings()
    models: dict[str, ModelTokenizer] = {}

    def api_settings(self) -> ApiSettings:
        """The api section, with the subscriber's bind policy for ``POST /engines``
        and the models' tokenizers."""
        if "engine_binds" in self.api:
            raise ConfigError("api: engine_binds is the subscriber's: set subscriber.bind")
        if "models" in self.api:
            raise ConfigError("api: models is a section of its own: move it to the top level")
        if self.models and (missing := missing_extra()):
            raise ConfigError(
                f"models: {', '.join(self.models)} configured, but the {EXTRA} extra is not"
                f" installed ({INSTALL}; missing {', '.join(missing)})"
            )
        section = {**self.api, "engine_binds": self.subscriber.bind, "models": self.models}
        return _dataclass(ApiSettings, section, "api")

    def check_binds(self, engines: Sequence[EngineSpec] = ()) -> None:
        """Refuse the file's and flags' engines that would bind where they may not."""
        for spec in [*self.engines, *engines]:
            try:
                self.subscriber.bind.check(spec)
            except BindRefused as e:
                raise ConfigError(str(e)) from None

    def discovery_sources(self, urls: Sequence[str] = ()) -> list[Source]:
        """The file's ``discover`` sources, then ``urls`` (the flags'); a bad URL is a
        ConfigError naming it."""
        try:
            return [open_source(url) for url in [*self.discover, *urls]]
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def url_engines(self, flags: Sequence[EngineUrl] = ()) -> list[EngineUrl]:
        """The file's ``engine_urls``, then ``flags`` (``--engine-url``); a bad entry is a
        ConfigError naming it."""
        try:
            return [_engine_url(entry) for entry in self.engine_urls] + list(flags)
        except ValueError as e:
            raise ConfigError(f"engine_urls: {e}") from None

    def redis_config(
        self, url: str | None, *, cluster: bool = False, prefix: str | None = None
    ) -> RedisConfig | None:
        """The Redis store's config; the flags (``url``, ``cluster``, ``prefix``)
        override the file's. None: no Redis at all."""
        if self.redis is None and url is None:
            return None
        section = dict(self.redis or {})
        flags = {"url": url, "cluster": cluster or None, "prefix": prefix}
        section.update((k, v) for k, v in flags.items() if v is not None)
        return _dataclass(RedisConfig, section, "redis")


def _engine_url(entry: str | dict[str, Any]) -> EngineUrl:
    if isinstance(entry, str):
        return parse_engine_url(entry)
    fields = dict(entry)
    url = fields.pop("url", None)
    if not isinstance(url, str):
        raise ValueError(f"{entry!r}: expected a url")
    return engine_url(url, fields)


def _dataclass(cls: type, section: dict[str, Any], name: str) -> Any:
    unknown = set(section) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
        raise ConfigError(f"{name}: unknown field(s) {', '.join(sorted(unknown))}")
    try:
        return msgspec.convert(section, cls, strict=False)
    except (msgspec.ValidationError, ValueError) as e:
        raise ConfigError(f"{name}: {e}") from None


class _OverFile(BaseSettings):
    """``KVINDEX_<SECTION>__<FIELD>`` variables over the config file's fields:
    pydantic-settings merges the two section by section, field by field."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_nested_delimiter="__", extra="allow"
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return env_settings, init_settings


#: Every section of the file but ``engines``, which the ``--engine`` flag (and
#: so ``KVINDEX_ENGINE``) adds to.
_Sections = pydantic.create_model(
    "_Sections",
    __base__=_OverFile,
    **{
        f.name: ((list[Any] if get_origin(f.type) is list else dict[str, Any]) | None, None)
        for f in msgspec.structs.fields(ServeConfig)
        if f.name != "engines"
    },
)


def load_config(path: str | Path | None = None) -> ServeConfig:
    """Read a YAML or TOML config file (TOML when the name ends in ``.toml``), its
    fields overridden by ``KVINDEX_<SECTION>__<FIELD>`` variables; without a
    file, the variables over the defaults. Values from variables are text, so
    numbers and booleans are read from text too (``"5"``, ``"true"``)."""
    where = str(path) if path is not None else f"{ENV_PREFIX}* variables"
    try:
        data = _read(Path(path)) if path is not None else {}
        merged = _Sections(**(data or {})).model_dump(exclude_none=True)
        return msgspec.convert(merged, ServeConfig, strict=False)
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: {_yaml_problem(e)}") from None
    except OSError as e:
        raise ConfigError(f"{where}: {e.strerror}") from None
    except pydantic.ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, p['loc']))}: {p['msg']}" for p in e.errors())
        raise ConfigError(f"{where}: {problems}") from None
    except (tomllib.TOMLDecodeError, msgspec.ValidationError) as e:
        raise ConfigError(f"{where}: {e}") from None


def _read(path: Path) -> Any:
    text = path.read_text()
    return tomllib.loads(text) if path.suffix == ".toml" else yaml.safe_load(text)


def _yaml_problem(error: yaml.YAMLError) -> str:
    """PyYAML's error in one line (its own text spans several, with a caret drawing)."""
    if not isinstance(error, yaml.MarkedYAMLError) or error.problem_mark is None:
        return f"not valid YAML: {' '.join(str(error).split())}"
    mark = error.problem_mark
    where = f"line {mark.line + 1}, column {mark.column + 1}"
    context = f" ({error.context})" if error.context else ""
    return f"YAML syntax error at {where}: {error.problem}{context}"


def resolve_auth_token(
    settings: ApiSettings, token_file: str | None = None, environ: Mapping[str, str] = os.environ
) -> ApiSettings:
    """The settings with ``auth_token`` from the first source that has one:
    ``token_file`` (``--auth-token-file``), ``$KVINDEX_AUTH_TOKEN``,
    ``api.auth_token_file``, ``api.auth_token``. A file or the environment
    keeps the token out of ``ps`` and out of a config file others may read."""
    from_env = environ.get(AUTH_TOKEN_ENV, "").strip()
    if token_file:
        token = _read_token(token_file)
    elif from_env:
        token = from_env
    elif settings.auth_token_file:
        token = _read_token(settings.auth_token_file)
    else:
        return settings
    return dataclasses.replace(settings, auth_token=token)


def _read_token(path: str) -> str:
    try:
        token = Path(path).read_text().strip()
    except OSError as e:
        raise ConfigError(f"auth token file {path}: {e.strerror}") from None
    if not token:
        raise ConfigError(f"auth token file {path} is empty")
    return token


def refuse_open_door(host: str, settings: ApiSettings) -> None:
    """Raise :class:`OpenDoor` when a non-loopback listener would have no token."""
    if is_loopback(host) or settings.auth_token is not None:
        return
    raise OpenDoor(
        f"--host {host} is reachable from other machines and no auth token is set, so anyone"
        f" could register or remove engines: set ${AUTH_TOKEN_ENV}, --auth-token-file or"
        " api.auth_token_file (or pass --insecure-no-auth to run open anyway)"
    )
