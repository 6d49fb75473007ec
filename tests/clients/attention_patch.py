"""An attention patch as fine-tuning repositories apply it at import time (FastChat's
``replace_llama_attn_with_flash_attn``, LongLoRA's shifted sparse attention): ``LlamaAttention.forward`` replaced by a
function of this module. This one runs the eager kernel (matmul and softmax) wherever the config names another, as a
patch written for a GPU without flash-attn would; the model's config still reads ``sdpa``.

``apply_rope`` is the other kind of patch, the one Liger's ``apply_liger_kernel_to_llama(rope=True)`` applies: no forward
is replaced, but the module-level ``apply_rotary_pos_emb`` that ``LlamaAttention.forward`` looks up at each call is. This
one rotates in bfloat16, as a fused kernel that keeps its operands in a lower precision would.

Knows nothing about healthcheck.
"""

import functools

import torch


def apply():
    from transformers.models.llama import modeling_llama

    original = modeling_llama.LlamaAttention.forward

    @functools.wraps(original)  # as patches do: the same name, docstring and signature as transformers' forward
    def forward(self, *args, **kwargs):
        kernel, self.config._attn_implementation = self.config._attn_implementation, "eager"
        try:
            return original(self, *args, **kwargs)
        finally:
            self.config._attn_implementation = kernel

    modeling_llama.LlamaAttention.forward = forward


def apply_rope():
    from transformers.models.llama import modeling_llama

    original = modeling_llama.apply_rotary_pos_emb

    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        low = (t.to(torch.bfloat16) for t in (q, k, cos, sin))
        q_rot, k_rot = original(*low, *args, **kwargs)
        return q_rot.to(q.dtype), k_rot.to(k.dtype)

    modeling_llama.apply_rotary_pos_emb = apply_rotary_pos_emb
