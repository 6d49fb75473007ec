"""accelerate's FSDP plugin kept on a CPU host, for the clients' ``--fsdp2`` (a test shim, not a user's code).

accelerate turns FSDP on only for accelerator device types: under ``MULTI_CPU`` its ``AcceleratorState`` drops the
plugin and the Trainer wraps DDP. :class:`FsdpOnCpu` sets the two fields accelerate sets on a GPU host, the plugin
(with its mixed precision, as accelerate sets it) and ``DistributedType.FSDP``, so everything after (``prepare``'s
``fsdp2_prepare_model``, clipping, the optimizer) is accelerate's and the Trainer's own FSDP2 code, over gloo.
"""

from accelerate import FullyShardedDataParallelPlugin
from accelerate.utils import DistributedType


class FsdpOnCpu:
    """Mix in before a ``transformers.Trainer`` class (``class T(FsdpOnCpu, SFTTrainer)``); its ``args`` carry the
    ``fsdp`` and ``fsdp_config`` settings."""

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        state = self.accelerator.state
        plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
        if state.mixed_precision != "no":  # as AcceleratorState does where it keeps the plugin
            plugin.set_mixed_precision(state.mixed_precision)
        state.fsdp_plugin = plugin
        state.distributed_type = DistributedType.FSDP
        self.is_fsdp_enabled = True


#: TrainingArguments for FSDP2 with a fully_shard per Llama decoder layer (what a GPU user writes).
FSDP2_ARGS = {"fsdp": "full_shard auto_wrap", "fsdp_config": {"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}}
