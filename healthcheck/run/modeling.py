"""The model under test: built-in presets (random init, no download), local directories, hub ids.

Presets pair a transformers config with a byte-level tokenizer that is built in memory, so the
embedded default needs no network at all. A local directory goes through the real
``AutoTokenizer``/``AutoModelForCausalLM.from_pretrained`` path.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable

from healthcheck.config import ModelConfig
from healthcheck.errors import InvalidInput

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _gpt2(n_layer: int, n_embd: int, n_head: int) -> Callable[[int, int], Any]:
    def build(vocab_size: int, max_positions: int):
        from transformers import GPT2Config

        return GPT2Config(
            n_layer=n_layer,
            n_embd=n_embd,
            n_head=n_head,
            n_positions=max_positions,
            vocab_size=vocab_size,
            bos_token_id=0,
            eos_token_id=0,
        )

    return build


def _llama(layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int) -> Callable[[int, int], Any]:
    def build(vocab_size: int, max_positions: int):
        from transformers import LlamaConfig

        return LlamaConfig(
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            vocab_size=vocab_size,
            max_position_embeddings=max_positions,
            bos_token_id=0,
            eos_token_id=0,
            tie_word_embeddings=False,
        )

    return build


#: name -> (description, config builder). Sizes are for the byte-level vocabulary (258 tokens).
PRESETS: dict[str, tuple[str, Callable[[int, int], Any]]] = {
    "tiny-gpt2": ("GPT-2, 2 layers, d=64 (~0.1M params): the embedded default", _gpt2(2, 64, 4)),
    "small-gpt2": ("GPT-2, 4 layers, d=256 (~3.3M params): a second size for overhead scaling", _gpt2(4, 256, 4)),
    "tiny-llama": ("Llama, 2 layers, d=64, GQA 4/2 heads (~0.1M params)", _llama(2, 64, 172, 4, 2)),
    "llama-1b": ("Llama, 16 layers, d=2048, GQA 32/8 heads (~1B params): GPU validation", _llama(16, 2048, 8192, 32, 8)),
}


def model_source(name: str) -> str:
    """Classify ``model.name`` as ``preset``, ``local`` or ``hub``; fail on a missing dir or unknown preset.

    >>> model_source("tiny-gpt2")
    'preset'
    >>> model_source("meta-llama/Llama-3.2-1B")
    'hub'
    """
    if name in PRESETS:
        return "preset"
    path = Path(name).expanduser()
    if path.is_dir():
        return "local"
    looks_like_path = name.startswith((".", "/", "~")) or name.count("/") > 1 or name.endswith("/")
    if looks_like_path or path.exists():
        raise InvalidInput(f"model.name: model directory not found: {name}")
    if _HUB_ID.match(name):
        return "hub"
    raise InvalidInput(f"model.name: unknown preset {name!r} (presets: {', '.join(PRESETS)}; or give a local directory or org/name hub id)")


def byte_level_tokenizer():
    """A real fast tokenizer over the 256 byte values plus EOS and PAD, built without any download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {EOS_TOKEN: 0, PAD_TOKEN: 1}
    for index, symbol in enumerate(sorted(alphabet)):
        vocab[symbol] = index + 2
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN)


def load_tokenizer(config: ModelConfig):
    source = model_source(config.name)
    if source == "preset":
        return byte_level_tokenizer()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config.name, trust_remote_code=config.trust_remote_code)
    if tokenizer.pad_token is None:
        # Causal LMs often ship without a pad token; padding positions are masked out of the loss anyway.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def build_model(config: ModelConfig, vocab_size: int, max_positions: int):
    """The model in ``config.dtype`` on the CPU; the caller moves it to its device.

    Presets are randomly initialised; DDP broadcasts rank 0's weights at wrap time, so every
    rank starts from identical parameters whatever its seed.
    """
    import torch
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, config.dtype)  # the config names torch dtypes exactly
    source = model_source(config.name)
    if source == "preset":
        hf_config = PRESETS[config.name][1](vocab_size, max(1024, max_positions))
        model = AutoModelForCausalLM.from_config(hf_config)
        return model.to(dtype)
    return AutoModelForCausalLM.from_pretrained(config.name, dtype=dtype, trust_remote_code=config.trust_remote_code)
