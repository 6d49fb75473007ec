"""model.patched_forwards: forwards whose code was written outside the package of the class that holds them;
model.patched_functions: functions and classes of the model's code modules replaced so."""

from __future__ import annotations

import functools

import torch

from healthcheck.measure.forward_patches import patched_forwards, patched_functions

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
# Liger's: a package of fused kernels whose module-level functions replace transformers' own.
_LIGER = {"__name__": "liger_kernel.transformers.rope", "functools": functools}
exec(  # noqa: S102 - as above
    "def wrap(original):\n"
    "    @functools.wraps(original)\n"
    "    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):\n"
    "        return original(q, k, cos, sin, *args, **kwargs)\n"
    "    return apply_rotary_pos_emb\n",
    _LIGER,
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


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2)
    return LlamaForCausalLM(config)


def test_a_module_level_function_and_class_replaced_by_another_package_are_named(monkeypatch):
    from transformers.models.llama import modeling_llama

    model = _tiny_llama()
    before = model(torch.arange(8).view(1, 8), labels=torch.arange(8).view(1, 8)).loss
    assert patched_functions(list(model.named_modules())) == "none"  # transformers' own decorators and imports are none
    # the Hub's `kernels` (transformers' dependency) wraps the attention forward with a decorator that only routes calls
    assert patched_forwards(list(model.named_modules())) == "none"
    # Liger's apply_liger_kernel_to_llama(rope=True, rms_norm=True): no forward changes, the module's names do
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", _LIGER["wrap"](modeling_llama.apply_rotary_pos_emb))
    monkeypatch.setattr(modeling_llama, "LlamaRMSNorm", torch.nn.RMSNorm)
    assert patched_forwards(list(model.named_modules())) == "none"
    assert patched_functions(list(model.named_modules())) == (
        "transformers.models.llama.modeling_llama.LlamaRMSNorm from torch.nn.modules.normalization.RMSNorm, "
        "transformers.models.llama.modeling_llama.apply_rotary_pos_emb from "
        "liger_kernel.transformers.rope.wrap.<locals>.apply_rotary_pos_emb")
    # the forward looks the function up at each call: the patch is what runs
    assert torch.equal(model(torch.arange(8).view(1, 8), labels=torch.arange(8).view(1, 8)).loss, before)


def test_a_function_torch_nn_functional_binds_by_assignment_is_read_too(monkeypatch):
    import torch.nn.functional as F

    net = torch.nn.Sequential(torch.nn.Linear(2, 2))
    assert patched_functions(list(net.named_modules())) == "none"
    # a builtin bound by assignment (`scaled_dot_product_attention = _add_docstr(...)`), replaced on one node
    monkeypatch.setattr(F, "scaled_dot_product_attention", _PATCH["wrap"](F.scaled_dot_product_attention))
    assert patched_functions(list(net.named_modules())) == (
        "torch.nn.functional.scaled_dot_product_attention from "
        "fastchat.train.llama_flash_attn_monkey_patch.wrap.<locals>.forward")


def test_healthchecks_own_loss_wrapper_is_seen_through_to_what_it_wraps(monkeypatch):
    import torch.nn.functional as F

    from healthcheck.integrations import loss_hooks

    net = torch.nn.Sequential(torch.nn.Linear(2, 2))
    loss_hooks.patch_cross_entropy()  # what script mode installs before the script runs
    try:
        assert patched_functions(list(net.named_modules())) == "none"
    finally:
        loss_hooks.unpatch()
    # a node's own cross-entropy, applied at import before the capture wraps it
    monkeypatch.setattr(F, "cross_entropy", _PATCH["wrap"](F.cross_entropy))
    loss_hooks.patch_cross_entropy()
    try:
        assert F.cross_entropy.__code__.co_name == "cross_entropy"  # the capture's, on top
        assert patched_functions(list(net.named_modules())) == (
            "torch.nn.functional.cross_entropy from fastchat.train.llama_flash_attn_monkey_patch.wrap.<locals>.forward")
    finally:
        loss_hooks.unpatch()


def test_fsdp2s_class_for_a_sharded_layer_keeps_its_bases_forward_and_a_patch_under_it_shows():
    from torch.distributed.fsdp import FSDPModule
    from transformers.models.llama import modeling_llama

    model = _tiny_llama()
    layer = model.model.layers[0]
    # what fully_shard does to each module it shards, without a process group: a class of its own, made in torch,
    # whose forward transformers' GradientCheckpointingLayer.__init_subclass__ wraps
    made_in = {"__module__": "torch.distributed.fsdp._fully_shard._fully_shard"}  # where fully_shard calls type()
    layer.__class__ = type(f"FSDP{type(layer).__name__}", (FSDPModule, type(layer)), made_in)
    assert "forward" in vars(type(layer)) and type(layer).__module__.startswith("torch.")
    assert patched_forwards(list(model.named_modules())) == "none"
    original = modeling_llama.LlamaAttention.forward
    modeling_llama.LlamaAttention.forward = _PATCH["wrap"](original)
    try:
        assert patched_forwards(list(model.named_modules())) == (
            "LlamaAttention.forward from fastchat.train.llama_flash_attn_monkey_patch.wrap.<locals>.forward")
    finally:
        modeling_llama.LlamaAttention.forward = original


def test_a_mask_patch_in_transformers_shared_modules_is_named_and_is_what_runs(monkeypatch):
    from transformers import masking_utils, modeling_flash_attention_utils

    model = _tiny_llama()
    ids, mask = torch.arange(8).view(1, 8), torch.ones(1, 8, dtype=torch.long)
    mask[0, 0] = 0  # left padding: sdpa is given the mask instead of is_causal
    before = model(ids, attention_mask=mask).logits
    assert patched_functions(list(model.named_modules())) == "none"
    # a node's launch path lets each token see the next one too: an off-by-one in a packing patch's mask
    sees_ahead = eval("lambda batch_idx, head_idx, q_idx, kv_idx: kv_idx <= q_idx + 1", {"__name__": "packing.mask"})
    monkeypatch.setattr(masking_utils, "causal_mask_function", sees_ahead)
    # axolotl-style multipack replaces the unpadding helper of flash-attention's path
    monkeypatch.setattr(modeling_flash_attention_utils, "_get_unpad_data", _LIGER["wrap"](lambda mask: mask))
    assert patched_functions(list(model.named_modules())) == (
        "transformers.masking_utils.causal_mask_function from packing.mask.<lambda>, "
        "transformers.modeling_flash_attention_utils._get_unpad_data from "
        "liger_kernel.transformers.rope.wrap.<locals>.apply_rotary_pos_emb")
    assert not torch.allclose(model(ids, attention_mask=mask).logits, before)  # looked up at each call: the patch runs


def test_a_mask_function_registered_over_sdpa_is_named():
    from transformers import AttentionMaskInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    from healthcheck.measure.forward_patches import mask_function

    assert mask_function("sdpa") == "transformers.masking_utils.sdpa_mask"
    original = ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]
    AttentionMaskInterface.register("sdpa", _PATCH["wrap"](original))
    try:
        assert mask_function("sdpa") == "fastchat.train.llama_flash_attn_monkey_patch.wrap.<locals>.forward"
    finally:
        AttentionMaskInterface.register("sdpa", original)
