"""An attention patch as fine-tuning repositories apply it at import time (FastChat's
``replace_llama_attn_with_flash_attn``, LongLoRA's shifted sparse attention): ``LlamaAttention.forward`` replaced by a
function of this module. This one runs the eager kernel (matmul and softmax) wherever the config names another, as a
patch written for a GPU without flash-attn would; the model's config still reads ``sdpa``.

Knows nothing about healthcheck.
"""

import functools


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
