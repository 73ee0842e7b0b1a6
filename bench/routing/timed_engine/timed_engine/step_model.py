"""How long one engine step takes on a GPU, from what the step schedules.

One step (one forward pass over every token the scheduler put in the batch: prefill
chunks and one token per decoding sequence) is modelled as

    step = FIXED + PER_TOKEN * tokens + PER_CONTEXT_TOKEN * context

- ``FIXED``: every step reads all the weights from memory once, however few tokens it
  carries (this is what makes a decode step cost about the same for 1 or 8 sequences);
- ``PER_TOKEN``: each scheduled token costs 2 FLOPs per parameter (a prefill token and a
  decoding sequence's one token alike: a decode sequence costs one token);
- ``PER_CONTEXT_TOKEN``: each sequence in the step reads the KV cache of its context (every
  token before its last scheduled one), the term that grows with context length.

Calibration: Llama 3.1 8B on one NVIDIA H100 SXM, bf16, from published figures:

- NVIDIA's H100 SXM datasheet: 989 TFLOPS dense BF16 Tensor Core, 3.35 TB/s HBM3;
- Meta's Llama 3.1 8B model card and config: 8.03 B parameters (16.06 GB in bf16),
  32 layers, 8 KV heads of dimension 128 (grouped-query attention), so a token's KV cache
  is 2 (K and V) x 32 x 8 x 128 x 2 bytes = 131,072 bytes;
- efficiencies assumed here (not published figures): 50% of peak FLOPS in the matrix
  multiplications, 80% of peak memory bandwidth.

Hence FIXED = 16.06 GB / (0.8 x 3.35 TB/s) = 5.99 ms; PER_TOKEN = 2 x 8.03e9 FLOP /
(0.5 x 989e12 FLOP/s) = 32.5 us; PER_CONTEXT_TOKEN = 131,072 B / (0.8 x 3.35 TB/s) =
48.9 ns. A 1,000-token prompt's prefill is then about 38 ms and a decode step of 8
sequences at 1,000 tokens of context about 6.6 ms.

The tiny CPU model computes its real forward pass in milliseconds of CPU too, so the
engine sleeps ``scale`` times the modelled time (minus what the real pass took): the
fleet runs ``scale`` times slower than the GPU would, and the real work stays a small
part of each step. Figures measured on the fleet are in wall time; divide by ``scale``
for the GPU's.
"""

from __future__ import annotations

from collections.abc import Sequence

FIXED_S = 16.06e9 / (0.8 * 3.35e12)
PER_TOKEN_S = 2 * 8.03e9 / (0.5 * 989e12)
PER_CONTEXT_TOKEN_S = 131_072 / (0.8 * 3.35e12)


def step_seconds(positions: Sequence[int]) -> float:
    """The modelled GPU time of a step scheduling tokens at ``positions`` (each token's place
    in its sequence, sequences one after the other, as vLLM lays out a batch)."""
    return FIXED_S + PER_TOKEN_S * len(positions) + PER_CONTEXT_TOKEN_S * context(positions)


def context(positions: Sequence[int]) -> int:
    """The KV-cache tokens the step reads: per sequence (a run of consecutive positions),
    the tokens before its last scheduled one."""
    total = 0
    for i, here in enumerate(positions):
        if i + 1 == len(positions) or positions[i + 1] != here + 1:
            total += here  # the run ends here: its sequence has ``here`` tokens before
    return total
