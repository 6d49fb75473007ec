"""model.patched_forwards: forwards whose code was written outside the package of the class that holds them."""

from __future__ import annotations

import functools

import torch

from healthcheck.measure.forward_patches import patched_forwards

# A patch module of another package, as FastChat's is: its functions' globals name it.
_PATCH = {"__name__": "fastchat.train.llama_flash_attn_monkey_patch", "functools": functools}
exec(  # noqa: S102 - the test needs code whose globals are another package's
    "def wrap(original):\n"
    "    @functools.wraps(original)\n"
    "    def forward(self, x):\n"
    "        return original(self, x) * 1.0\n"
    "    return forward\n",
    _PATCH,
)


class Attention(torch.nn.Linear):
    pass


def test_a_patch_wrapped_to_look_like_the_original_is_named_by_where_its_code_was_written():
    net = torch.nn.Sequential(Attention(2, 2), Attention(2, 2))
    assert patched_forwards(list(net.named_modules())) == "none"
    original = Attention.forward
    Attention.forward = _PATCH["wrap"](torch.nn.Linear.forward)  # the class's own now, copied name and all
    try:
        assert Attention.forward.__module__ == "torch.nn.modules.linear"  # functools.wraps hides it there
        assert patched_forwards(list(net.named_modules())) == (
            "Attention.forward from fastchat.train.llama_flash_attn_monkey_patch.wrap.<locals>.forward")
    finally:
        Attention.forward = original


def test_an_instances_own_forward_is_read_and_a_partial_unwrapped():
    net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    hooked = net[1]
    # accelerate's hooks: a partial of a function of theirs, bound to the module, set on the instance
    hooked.forward = functools.partial(_PATCH["wrap"](torch.nn.Linear.forward), hooked)
    assert patched_forwards(list(net.named_modules())) == (
        "Linear instance.forward from fastchat.train.llama_flash_attn_monkey_patch.wrap.<locals>.forward")
    assert hooked(torch.ones(1, 2)).shape == (1, 2)


def test_an_attention_registered_over_sdpa_is_named_though_no_forward_changed():
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from healthcheck.measure.forward_patches import attention_function

    assert attention_function("sdpa") == "transformers.integrations.sdpa_attention.sdpa_attention_forward"
    assert attention_function("eager") is None  # each model's own function, outside the registry
    original = ALL_ATTENTION_FUNCTIONS["sdpa"]
    AttentionInterface.register("sdpa", _PATCH["wrap"](original))  # a node's launch path registers its own
    try:
        assert attention_function("sdpa") == "fastchat.train.llama_flash_attn_monkey_patch.wrap.<locals>.forward"
    finally:
        AttentionInterface.register("sdpa", original)
