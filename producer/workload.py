"""A synthetic chat workload with the shape that makes prefix caching pay off.

Real traffic shares long prefixes in two ways: many conversations start with
one of a few system prompts (some far more popular than others), and every
turn of a conversation resends the whole history. This generator produces
both, deterministically from a seed, so a simulated engine's caches fill,
hit and evict the way a real engine's do and a test can replay the exact
same traffic.

Requests arrive as a Poisson process at ``rate`` per second; arrival times
are part of the deterministic stream, the caller decides how they map to
wall-clock time. Output tokens are drawn up front: the simulated engine
"generates" exactly them, so the next turn of the conversation can resend
them and hit the cache.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    """Knobs of the workload. Token ranges are inclusive ``(low, high)``.

    ``zipf_s`` skews the choice of system prompt: prompt ``i`` is picked
    with weight ``1 / (i + 1) ** zipf_s`` (0 is uniform). ``seed`` fixes
    the system prompts; streams of one config share them, so several engines
    fed by different streams hold the same popular prefixes.
    """

    seed: int = 0
    rate: float = 4.0
    system_prompts: int = 8
    system_prompt_tokens: tuple[int, int] = (128, 512)
    zipf_s: float = 1.1
    user_tokens: tuple[int, int] = (8, 96)
    output_tokens: tuple[int, int] = (8, 128)
    max_turns: int = 6
    max_context_tokens: int = 2048
    active_conversations: int = 16
    new_conversation_prob: float = 0.3
    vocab_size: int = 32000

    def __post_init__(self) -> None:
        if self.rate <= 0 or self.system_prompts < 1 or self.active_conversations < 1:
            raise ValueError("rate, system_prompts and active_conversations must be positive")
        longest_first_turn = (
            self.system_prompt_tokens[1] + self.user_tokens[1] + self.output_tokens[1]
        )
        if longest_first_turn > self.max_context_tokens:
            raise ValueError(
                f"a first turn can take {longest_first_turn} tokens, more than "
                f"max_context_tokens={self.max_context_tokens}"
            )


@dataclass(frozen=True, slots=True)
class Request:
    """One turn: the prompt to send and the reply the engine will produce."""

    arrival: float
    conversation: int
    turn: int
    system_prompt: int
    prompt: tuple[int, ...]
    output: tuple[int, ...]


@dataclass(slots=True)
class _Conversation:
    ident: int
    system_prompt: int
    history: tuple[int, ...]  # every token sent and received so far
    turns: int = 0


class Workload:
    """An endless, deterministic stream of chat requests.

    ``stream`` selects an independent stream of the same config: same system
    prompts, different conversations and arrivals.
    """

    def __init__(self, config: WorkloadConfig, stream: int = 0) -> None:
        self.config = config
        prompts_rng = random.Random(config.seed)
        self.system_prompts = [
            self._tokens(prompts_rng, config.system_prompt_tokens)
            for _ in range(config.system_prompts)
        ]
        self._weights = [1 / (i + 1) ** config.zipf_s for i in range(config.system_prompts)]
        self._rng = random.Random(f"{config.seed}/{stream}")
        self._active: list[_Conversation] = []
        self._clock = 0.0
        self._conversations = 0

    def __iter__(self) -> Iterator[Request]:
        return self

    def __next__(self) -> Request:
        self._clock += self._rng.expovariate(self.config.rate)
        conversation = self._pick()
        prompt = conversation.history + self._tokens(self._rng, self.config.user_tokens)
        output = self._tokens(self._rng, self.config.output_tokens)
        conversation.history = prompt + output
        conversation.turns += 1
        return Request(
            self._clock,
            conversation.ident,
            conversation.turns,
            conversation.system_prompt,
            prompt,
            output,
        )

    def _pick(self) -> _Conversation:
        """Continue an active conversation, or start one (and retire finished ones)."""
        cfg = self.config
        room = cfg.max_context_tokens - cfg.user_tokens[1] - cfg.output_tokens[1]
        self._active = [
            c for c in self._active if c.turns < cfg.max_turns and len(c.history) <= room
        ]
        full = len(self._active) >= cfg.active_conversations
        if self._active and (full or self._rng.random() >= cfg.new_conversation_prob):
            return self._rng.choice(self._active)
        (system,) = self._rng.choices(range(len(self.system_prompts)), self._weights)
        self._conversations += 1
        conversation = _Conversation(self._conversations, system, self.system_prompts[system])
        self._active.append(conversation)
        return conversation

    def _tokens(self, rng: random.Random, span: tuple[int, int]) -> tuple[int, ...]:
        vocab = self.config.vocab_size
        return tuple(rng.randrange(vocab) for _ in range(rng.randint(*span)))
