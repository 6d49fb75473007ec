"""What the replay audit differentiates in a --script probe: the model's own loss, else a surrogate of its outputs."""

from __future__ import annotations

import pytest
import torch

from healthcheck.integrations.script.replay_batch import BatchKeeper, model_loss, output_surrogate, unavailable
from healthcheck.measure.replay import replay_gradient


class Net(torch.nn.Module):
    """Logits as a tensor, a tuple or a dict; with ``labels``, a dict with its own loss too."""

    def __init__(self, shape: str = "tensor"):
        super().__init__()
        self.linear = torch.nn.Linear(3, 4)
        self.shape = shape

    def forward(self, x, labels=None):
        logits = self.linear(x)
        if labels is not None:
            return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}
        return {"tensor": logits, "tuple": (logits, None), "dict": {"logits": logits, "cache": object()}}[self.shape]


def kept_batch(net: Net, *args, **kwargs) -> dict:
    keeper = BatchKeeper(net)
    net(*args, **kwargs)
    keeper.close()
    return keeper.batch


def test_a_model_given_labels_is_differentiated_through_its_own_loss():
    net, x, labels = Net(), torch.randn(5, 3), torch.tensor([0, 1, 2, 3, 0])
    batch = kept_batch(net, x, labels=labels)
    assert unavailable(batch) is None
    assert torch.equal(model_loss(net, batch), net(x, labels=labels)["loss"])


@pytest.mark.parametrize("shape", ["tensor", "tuple", "dict"])
def test_without_a_loss_the_surrogate_reaches_every_parameter(shape):
    net, x = Net(shape), torch.randn(5, 3)
    batch = kept_batch(net, x)
    assert unavailable(batch) is None
    loss = model_loss(net, batch)
    assert float(loss.detach()) == pytest.approx(float(net.linear(x).detach().square().mean()))
    names = [name for name, _ in net.named_parameters()]
    _, grads = replay_gradient(net, lambda call: model_loss(call, batch), names, seed=0, device=torch.device("cpu"))
    assert all(g is not None and g.abs().sum() > 0 for g in grads)


def test_a_wrong_forward_changes_the_surrogate_gradient():
    # What the replay audit relies on: a device whose matmuls are slightly off gives another gradient.
    net, x = Net(), torch.randn(5, 3)
    batch = kept_batch(net, x)
    names = [name for name, _ in net.named_parameters()]
    _, right = replay_gradient(net, lambda call: model_loss(call, batch), names, seed=0, device=torch.device("cpu"))
    handle = net.linear.register_forward_hook(lambda module, args, out: out * (1 + 1e-3))
    _, wrong = replay_gradient(net, lambda call: model_loss(call, batch), names, seed=0, device=torch.device("cpu"))
    handle.remove()
    assert not torch.equal(right[0], wrong[0])


def test_no_training_forward_and_no_differentiable_output_are_refused():
    assert "no training forward" in unavailable(None)
    with pytest.raises(ValueError, match="no differentiable"):
        output_surrogate((torch.ones(2), None))  # an output that does not require grad


def test_a_forward_set_for_one_call_is_a_redirect_and_one_set_for_good_is_not():
    import torch

    from healthcheck.integrations.script.replay_batch import BatchKeeper, unavailable

    class Net(torch.nn.Linear):
        def training_step(self, x):
            return super().forward(x).sum()

    net, x = Net(2, 2), torch.ones(1, 2)
    kept = BatchKeeper(net)
    own = net.forward
    net.forward = lambda *args: net.training_step(*args)  # as Lightning's forward redirection does, for one call
    net(x)
    net.forward = own  # and puts the module's own back
    assert kept.redirected and "training_step" in unavailable(kept.batch, kept.redirected)
    wrapped, kept = Net(2, 2), None
    kept = BatchKeeper(wrapped)
    wrapped.forward = torch.no_grad()(wrapped.forward)  # a wrapper for good (accelerate's convert_outputs_to_fp32)
    wrapped(x)
    assert not kept.redirected and unavailable(kept.batch, kept.redirected) is None
    plain = Net(2, 2)
    kept = BatchKeeper(plain)
    plain(x)
    assert not kept.redirected
