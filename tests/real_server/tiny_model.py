"""A model vLLM serves without a hub: a tiny random-weight Llama and a byte-level BPE
tokenizer trained here, with a chat template (about 7 s).

``python tiny_model.py DIR`` writes it (torch and transformers are imported only
then: the tests import :data:`WORDS` alone). The tokenizer adds ``<s>`` to a
completions prompt; the chat template writes its own.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

SPECIALS = ["<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
#: Tools, when the request has them, in a system turn of their own (one JSON line each),
#: and an assistant's tool calls after its text (name, then the arguments as JSON).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% if tools %}{{ '<|system|>\\n' }}{% for t in tools %}"
    "{{ t | tojson + '\\n' }}{% endfor %}{{ '<|end|>\\n' }}{% endif %}"
    "{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + (m['content'] or '') }}"
    "{% for c in m['tool_calls'] or [] %}"
    "{{ c['function']['name'] + ' ' + c['function']['arguments'] | tojson + '\\n' }}"
    "{% endfor %}{{ '<|end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
VOCAB_SIZE = 2048


def _words(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    return ["".join(rng.choices(letters, k=rng.randint(2, 9))) for _ in range(count)]


#: the words of the training text, and of the tests' prompts
WORDS = _words(3000, 24)


def build(folder: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    rng = random.Random(7)
    text = [" ".join(rng.choices(WORDS, k=40)) for _ in range(4000)]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(text, trainer)
    bos = bpe.token_to_id("<s>")
    bpe.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token="<s>",
        eos_token="</s>",
        additional_special_tokens=SPECIALS[2:],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=4096,
        bos_token_id=bos,
        eos_token_id=bpe.token_to_id("</s>"),
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    config_file = folder / "tokenizer_config.json"
    saved = json.loads(config_file.read_text())
    saved.setdefault("chat_template", CHAT_TEMPLATE)
    config_file.write_text(json.dumps(saved, indent=1))


if __name__ == "__main__":
    build(Path(sys.argv[1]))
