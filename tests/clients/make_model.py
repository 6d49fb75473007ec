"""Create a tiny, fully local Llama model directory (model + tokenizer) for offline tests.

    from make_model import make_tiny_llama
    make_tiny_llama("/tmp/tiny-llama")            # returns the path

    python make_model.py /tmp/tiny-llama

The tokenizer is a byte-level BPE trained in memory (deterministically) on a small built-in corpus with the
`tokenizers` library and wrapped in PreTrainedTokenizerFast, with <|bos|>, <|eos|> and <|pad|> tokens. Both
`AutoTokenizer.from_pretrained(path)` and `AutoModelForCausalLM.from_pretrained(path)` work offline.
"""

from __future__ import annotations

import os
import sys

# A small built-in corpus: alpaca template words, English function words, digits and arithmetic so the merges are
# useful for the gsm8k / roleplay data without reading it here (the function stays independent of any data file).
_CORPUS = [
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.",
    "### Instruction:\n", "### Input:\n", "### Response:\n",
    "The quick brown fox jumps over the lazy dog. She sold half as many clips in May as she did in April.",
    "How many dollars did he earn altogether? He spent 3 hours and earned $12 an hour, so 3 * 12 = 36 dollars.",
    "Imagine you are a detective in a Victorian town. Describe the scene, the suspects and your plan.",
    "There are 48 apples and 24 oranges. 48 + 24 = 72 fruits in total. Each box holds 8, so 72 / 8 = 9 boxes.",
    "I would greet the guests, explain the rules of the game and then tell them a story about the old castle.",
    "What is the total cost? The total cost is 5 + 7 = 12. The answer is 12.",
    "As a wizard, I would use my magic to protect the village and to help the people who live there.",
    "0 1 2 3 4 5 6 7 8 9 10 100 1000 % $ = + - * / ( ) . , ! ? : ; ' \"",
    "they their there this that these those with from into about because would could should which where when",
    "first second third then next finally therefore however each every many much more most less least",
]


def _build_tokenizer(vocab_size: int = 512):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|pad|>", "<|bos|>", "<|eos|>", "<|unk|>"]
    tok = Tokenizer(models.BPE(unk_token="<|unk|>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        unk_token="<|unk|>",
        model_max_length=512,
    )
    fast.padding_side = "right"
    return fast


def make_tiny_llama(path: str, hidden_size: int = 64, num_layers: int = 2, vocab_size: int = 512, seed: int = 0) -> str:
    """Write a random-init 2-layer LlamaForCausalLM plus its tokenizer to `path` and return `path`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    os.makedirs(path, exist_ok=True)
    tokenizer = _build_tokenizer(vocab_size)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        use_cache=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else "/tmp/tiny-llama"
    make_tiny_llama(out)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t = AutoTokenizer.from_pretrained(out)
    m = AutoModelForCausalLM.from_pretrained(out)
    ids = t("### Instruction:\nHow many clips?\n\n### Response:\n72")["input_ids"]
    print(out, type(m).__name__, sum(p.numel() for p in m.parameters()), "params; vocab", len(t),
          "; eos/pad", t.eos_token_id, t.pad_token_id, "; example ids", len(ids))
