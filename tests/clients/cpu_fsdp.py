"""accelerate's FSDP plugin kept on a CPU host, for the clients' ``--fsdp2`` (a test shim, not a user's code).

accelerate turns FSDP on only for accelerator device types: under ``MULTI_CPU`` its ``AcceleratorState`` drops the
plugin and the Trainer wraps DDP. :func:`keep_fsdp_plugin` sets the two fields accelerate sets on a GPU host, the plugin
(with its mixed precision, as accelerate sets it) and ``DistributedType.FSDP``, so everything after (``prepare``'s
``fsdp2_prepare_model``, clipping, the optimizer) is accelerate's and the Trainer's own FSDP2 code, over gloo;
:class:`FsdpOnCpu` does it for a Trainer.
"""

from accelerate import FullyShardedDataParallelPlugin
from accelerate.utils import DistributedType


def keep_fsdp_plugin(state, plugin):
    """Set on accelerate's ``AcceleratorState`` what it sets where it keeps an FSDP plugin: the plugin, with the
    state's mixed precision (as ``AcceleratorState`` sets it), and ``DistributedType.FSDP``."""
    if state.mixed_precision != "no":
        plugin.set_mixed_precision(state.mixed_precision)
    state.fsdp_plugin = plugin
    state.distributed_type = DistributedType.FSDP


class FsdpOnCpu:
    """Mix in before a ``transformers.Trainer`` class (``class T(FsdpOnCpu, SFTTrainer)``); its ``args`` carry the
    ``fsdp`` and ``fsdp_config`` settings."""

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        keep_fsdp_plugin(self.accelerator.state, FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args))
        self.is_fsdp_enabled = True


#: TrainingArguments for FSDP2 with a fully_shard per Llama decoder layer (what a GPU user writes).
FSDP2_ARGS = {"fsdp": "full_shard auto_wrap", "fsdp_config": {"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}}
