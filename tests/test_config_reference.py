"""docs/configuration.md is what the settings models say: every field, documented."""

from __future__ import annotations

from scripts.config_reference import PAGE, page


def test_the_configuration_reference_is_current() -> None:
    assert PAGE.read_text() == page(), (
        "docs/configuration.md is stale: run .venv/bin/python -m scripts.config_reference"
    )
