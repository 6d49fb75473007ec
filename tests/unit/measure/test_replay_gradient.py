"""``replay_gradient`` in one process: the gradient of a plain backward, and nothing else touched.

Activation checkpointing recomputes blocks inside the backward; the reentrant kind refuses ``autograd.grad``
and, if the swap of parameters for leaves ended with the forward, would send its gradients to the real
parameters. Both kinds and none are checked against a plain backward of a copy of the model.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from healthcheck.measure.replay import replay_gradient


class Blocks(torch.nn.Module):
    def __init__(self, reentrant: bool | None):
        super().__init__()
        self.embed = torch.nn.Embedding(11, 8)
        block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.1), torch.nn.Tanh())
        self.blocks = torch.nn.ModuleList([block, copy.deepcopy(block)])
        self.head = torch.nn.Linear(8, 11, bias=False)
        self.head.weight = self.embed.weight  # tied, as language models tie their embeddings
        self.reentrant = reentrant

    def forward(self, ids, labels):
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h) if self.reentrant is None else checkpoint(block, h, use_reentrant=self.reentrant)
        return torch.nn.functional.cross_entropy(self.head(h).reshape(-1, 11), labels.reshape(-1))


@pytest.mark.parametrize("reentrant", [None, False, True], ids=["no checkpointing", "non-reentrant", "reentrant"])
def test_the_replay_gradient_is_a_plain_backwards_and_touches_no_parameter(reentrant):
    torch.manual_seed(0)
    model = Blocks(reentrant).train()
    ids, labels = torch.randint(0, 11, (3, 5)), torch.randint(0, 11, (3, 5))
    names = [name for name, p in model.named_parameters() if p.requires_grad]

    reference = copy.deepcopy(model)
    torch.manual_seed(7)  # the replay seeds its generators with its own seed: draw the same dropout masks
    reference_loss = reference(ids, labels)
    reference_loss.backward()
    loss, grads = replay_gradient(model, lambda call: call(ids, labels), names, seed=7, device=torch.device("cpu"))

    assert all(p.grad is None for p in model.parameters())  # the real parameters: no gradient, no hook ran
    expected = dict(reference.named_parameters())
    for name, grad in zip(names, grads, strict=True):
        assert torch.equal(grad, expected[name].grad), name
    assert float(loss) == float(reference_loss.detach())
