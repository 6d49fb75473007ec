"""Which forwards count as training before the first update: those a gradient flows back through."""

from __future__ import annotations

import torch

from healthcheck.integrations.script.forwards import TrainingForwards


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(3, 2)

    def forward(self, x):
        return {"logits": self.layer(x), "note": "text"}


def _watched():
    net = Net()
    forwards = TrainingForwards(lambda module: {"training": module.training})
    handles = forwards.attach(net)
    return net, forwards, handles


def test_a_sanity_forward_never_backwarded_is_not_counted_nor_read():
    net, forwards, _ = _watched()
    net.eval()
    net(torch.ones(1, 3))  # autograd on, output dropped: a sanity loss
    net.train()
    with torch.no_grad():
        net(torch.ones(1, 3))
    for _ in range(3):  # gradient accumulation over three micro-batches
        net(torch.ones(1, 3))["logits"].sum().backward()
    assert forwards.stop() == {"training": True, "forward_args": "#0 float32 2-d"} and forwards.count == 3
    net(torch.ones(1, 3))["logits"].sum().backward()  # after the first update: no longer counted
    assert forwards.count == 3


def test_one_backward_through_several_outputs_counts_once():
    net, forwards, _ = _watched()
    out = net(torch.ones(2, 3))
    (out["logits"][0].sum() + out["logits"][1].sum()).backward()
    assert forwards.count == 1


def test_outputs_without_gradients_leave_the_last_forwards_facts():
    net, forwards, handles = _watched()
    net.requires_grad_(False)
    net.eval()
    net(torch.ones(1, 3))
    assert forwards.count == 0 and forwards.stop() == {"training": False, "forward_args": "#0 float32 2-d"}
    for handle in handles:
        handle.remove()
    assert TrainingForwards(lambda module: {}).stop() == {}
