"""The model settings the environment audit compares: dropout rates, eval-mode modules, the attention kernel."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from healthcheck.judge.exact_audits import environment_audit
from healthcheck.measure.module_facts import module_facts


def tiny_llama(**overrides) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, **overrides)
    return LlamaForCausalLM(config)


def test_transformers_attention_dropout_is_read_off_its_attribute():
    # Llama keeps its attention dropout as a float on each attention module, not as an nn.Dropout.
    facts = module_facts(tiny_llama(attention_dropout=0.1))
    assert facts["model.dropout"] == "p=0.1 in 2 modules"
    assert facts["model.attn_implementation"] in ("eager", "sdpa")
    assert module_facts(tiny_llama())["model.dropout"] == "p=0 in 2 modules"


def test_dropout_modules_count_once_and_a_model_without_any_says_none():
    net = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Dropout(0.2), torch.nn.AlphaDropout(0.2), torch.nn.Dropout2d(0.5))
    assert module_facts(net)["model.dropout"] == "p=0.2 in 2 modules, p=0.5 in 1 module"
    assert module_facts(torch.nn.Linear(2, 2)) == {
        "model.dropout": "none",
        "model.eval_modules": "none of 1 in eval mode",
        "model.compile": "none",
        "model.patched_forwards": "none",
        "model.patched_functions": "none",
        "model.modules.Linear": "1x in_features=2, out_features=2, bias=True",
    }


def test_eval_mode_sets_of_equal_size_still_differ():
    model = tiny_llama()
    model.train()
    assert module_facts(model)["model.eval_modules"].startswith("none of ")
    model.model.layers[0].eval()
    first = module_facts(model)["model.eval_modules"]
    model.model.layers[0].train()
    model.model.layers[1].eval()
    second = module_facts(model)["model.eval_modules"]
    assert first.split(":")[0] == second.split(":")[0]  # as many modules
    assert first != second
    model.eval()
    assert module_facts(model)["model.eval_modules"].startswith("all ")


def test_the_environment_audit_names_the_rank_whose_settings_differ():
    base = {"versions": {"torch": "2"}, "env": {}, "device_name": "cpu", "precision": "fp32"}
    same, odd = module_facts(tiny_llama()), module_facts(tiny_llama(attention_dropout=0.1))
    outcome = environment_audit([{**base, **same}, {**base, **same}, {**base, **odd}, {**base, **same}, {**base, **same}])
    assert not outcome.passed and outcome.ranks == (2,)
    assert outcome.message == (
        "model.config.attention_dropout differs: ranks 0-1, 3-4 0.0; rank 2 0.1; "
        "model.dropout differs: ranks 0-1, 3-4 p=0 in 2 modules; rank 2 p=0.1 in 2 modules"
    )


def test_another_config_revision_is_named_by_its_key_and_by_the_modules_it_builds():
    # The same parameters, another function: only the settings tell the ranks apart.
    base = {"versions": {"torch": "2"}, "env": {}, "device_name": "cpu", "precision": "fp32"}
    same = module_facts(tiny_llama())
    odd = module_facts(tiny_llama(rms_norm_eps=1e-5))
    outcome = environment_audit([{**base, **same}, {**base, **odd}, {**base, **same}])
    assert not outcome.passed and outcome.ranks == (1,)
    assert outcome.details["differing"] == ["model.config.rms_norm_eps", "model.modules.LlamaRMSNorm"]
    assert "model.config.rms_norm_eps differs: ranks 0, 2 1e-06; rank 1 1e-05" in outcome.message
    assert "rank 1 5x (16,), eps=1e-05" in outcome.message
    rope = module_facts(tiny_llama(rope_parameters={"rope_type": "default", "rope_theta": 5e5}))
    assert rope["model.config.rope_parameters.rope_theta"] == "500000.0"
    assert same["model.config.rope_parameters.rope_theta"] == "10000.0"


def test_settings_that_cannot_change_a_step_are_not_compared():
    model = tiny_llama()
    facts = module_facts(model)
    model.config.use_cache = not model.config.use_cache
    model.config._name_or_path = "/scratch/node7/llama"
    assert module_facts(model) == facts
    assert not any(key.endswith(("transformers_version", "_name_or_path", "use_cache")) for key in facts)


def test_a_wrapped_model_is_read_through_its_wrapper_and_device_indices_are_not_differences():
    class Wrapper(torch.nn.Module):  # DDP and PEFT hold the transformers model as a child
        def __init__(self, module):
            super().__init__()
            self.module = module

    class OnDevice(torch.nn.Module):
        def __init__(self, index):
            super().__init__()
            self.index = index

        def extra_repr(self):
            return f"device=cuda:{self.index}, eps=1e-05"

    wrapped = module_facts(Wrapper(tiny_llama()))
    assert wrapped["model.config.rms_norm_eps"] == "1e-06"
    assert module_facts(OnDevice(0)) == module_facts(OnDevice(5))
    assert module_facts(OnDevice(0))["model.modules.OnDevice"] == "1x device=cuda:N, eps=1e-05"
