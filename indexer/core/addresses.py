"""Where an engine publishes, checked beyond each endpoint's own syntax.

Pure rules over an engine's declared fields, so that ``POST /engines``, the
config file and ``--engine`` refuse alike, with a message that names the field.
"""

from __future__ import annotations


def check_topic_and_replay(
    topic: str, endpoint: str | None, replay: str | None, bind: bool
) -> None:
    """Raise ValueError for a topic ZeroMQ would take but no engine sends (a NUL: vLLM's
    topic is text, and C tools cut it there), or for a replay endpoint that is the
    live one: the engine's replay ROUTER needs an address of its own, and with
    ``bind: true`` kvindex would send its replay requests to its own SUB."""
    if "\0" in topic:
        raise ValueError(f"topic: holds a NUL character ({topic!r}); a topic is text")
    if replay is not None and replay == endpoint:
        listener = "kvindex's own SUB (bind: true)" if bind else "the engine's PUB"
        raise ValueError(
            f"replay_endpoint: {replay} is the endpoint, where {listener} listens; the"
            " engine's replay socket needs an address of its own"
        )
