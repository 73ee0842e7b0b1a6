"""kvindex HTTP API: prefix-match for routers, REST and metrics for operators."""

from api.app import create_app
from api.settings import ApiSettings

__all__ = ["ApiSettings", "create_app"]
