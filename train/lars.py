"""LARS: SGD whose every layer's step is scaled by that layer's trust ratio (You, Gitman and Ginsburg, 2017).

At large global batches the linear scaling rule's rate makes some layers'
steps far larger than their weights (in the paper, the ratio of weight norm
to gradient norm differs by orders of magnitude between a ResNet's layers),
and training diverges however long the warm-up. LARS gives each layer the
rate ``lr * eta * |w| / (|g| + lambda * |w|)``: the step's size follows the
weights' size. It is the optimizer of MLPerf's large-batch ResNet-50 runs.

For a layer's weights ``w``, its gradient ``g``, weight decay ``lambda``,
trust coefficient ``eta`` and momentum ``m``, one step is::

    ratio = eta * |w| / (|g| + lambda * |w|)     (1 where |w| or |g| is 0)
    d     = ratio * (g + lambda * w)
    buf   = m * buf + d                           (as torch.optim.SGD's momentum)
    w    -= lr * buf                              (w -= lr * (d + m * buf) with Nesterov)

Batch-norm scales and shifts and biases (1-d tensors; the same rule as weight
decay's, :func:`dimd.train.sgd.decays`) take neither the ratio nor weight decay,
as in MLPerf's reference: they step as under plain SGD with momentum.

The rate is outside the momentum buffer, as in ``torch.optim.SGD`` (the paper
and MLPerf put it inside): the same steps at a constant rate, and a changed
rate takes effect at once. The rate may be a 0-d tensor on the parameters'
device, which a CUDA graph reads at each replay; a number and a tensor of the
same value give the same bits. The norms are computed on the device by the
multi-tensor (``torch._foreach_*``, through :func:`dimd.private_apis.foreach`) ops torch's
own optimizers use: no per-layer Python loop and no device-to-host copy per
step, so a CUDA graph can capture the step. The momentum buffers are made
(zeros) at the first step, in ``state[p]["momentum_buffer"]`` as SGD keeps
them; ``state_dict``/``load_state_dict`` carry them, so a resume continues exactly.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Union

import torch

from dimd.errors import ConfigError
from dimd.private_apis import foreach
from dimd.train.config import LARS_TRUST
from dimd.train.sgd import decays

#: What the foreach ops take and give: a list or a tuple of tensors.
Tensors = Union[list[torch.Tensor], tuple[torch.Tensor, ...]]


class LARS(torch.optim.Optimizer):
    """Layer-wise adaptive rate scaling over SGD with momentum (see the module's docstring for the step).

    ``params``: parameters or groups, as any ``torch.optim`` optimizer takes them. Per group:
    ``lr`` (a number or a 0-d tensor on the parameters' device), ``momentum``, ``weight_decay``
    (lambda), ``trust`` (eta, > 0), ``nesterov``, and ``decay_bn_and_bias`` (give 1-d parameters
    the ratio and weight decay too, as :func:`dimd.train.sgd.decays` says for weight decay).
    """

    #: Its step reads a 0-d tensor rate as it is, on the device (so S-SGD's step, graphed or not, can use it).
    reads_tensor_rate = True

    def __init__(self, params: Iterable[Any], lr: float | torch.Tensor, momentum: float = 0.0,
                 weight_decay: float = 0.0, trust: float = LARS_TRUST, nesterov: bool = False,
                 decay_bn_and_bias: bool = False) -> None:
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, trust=trust, nesterov=nesterov,
                        decay_bn_and_bias=decay_bn_and_bias)
        check_settings(defaults)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        check_settings(self.param_groups[-1])

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One LARS step over every parameter that has a gradient; ``closure`` re-evaluates the loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for (params, grads, buffers), adapt in self._collect(group):
                directions = self._directions(params, grads, group) if adapt else grads
                self._apply(params, directions, buffers, group)
        return loss

    def _collect(self, group: dict[str, Any]) -> list[tuple[tuple[list, list, list], bool]]:
        """The group's parameters with a gradient, split by device and dtype (the foreach ops' lists) and
        by whether they take the trust ratio: (params, grads, momentum buffers) per part. One pass over the
        parameters, as torch's own foreach optimizers make to gather their lists."""
        parts: dict[tuple[torch.device, torch.dtype, bool], tuple[list, list, list]] = {}
        momentum = group["momentum"] != 0
        for p in group["params"]:
            if p.grad is None:
                continue
            lists = parts.setdefault((p.device, p.dtype, decays(p, group["decay_bn_and_bias"])), ([], [], []))
            lists[0].append(p)
            lists[1].append(p.grad)
            if momentum:
                state = self.state[p]
                if state.get("momentum_buffer") is None:
                    state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                lists[2].append(state["momentum_buffer"])
        return [(lists, adapt) for (_, _, adapt), lists in parts.items()]

    @staticmethod
    def _directions(params: list[torch.Tensor], grads: list[torch.Tensor],
                    group: dict[str, Any]) -> Tensors:
        """Each layer's ``ratio * (g + lambda * w)``, its norms computed on the device; ``.grad`` is left as it is
        (S-SGD's gradients are views of its flat buffer)."""
        decay, trust = group["weight_decay"], group["trust"]
        weight_norms = torch.stack(foreach("norm")(params))
        grad_norms = torch.stack(foreach("norm")(grads))
        ratios = trust * weight_norms / (grad_norms + decay * weight_norms)
        ratios = torch.where((weight_norms > 0) & (grad_norms > 0), ratios, torch.ones_like(ratios))
        if not decay:
            return foreach("mul")(grads, list(ratios.unbind()))
        directions = foreach("add")(grads, params, alpha=decay)
        foreach("mul_")(directions, list(ratios.unbind()))
        return directions

    @staticmethod
    def _apply(params: list[torch.Tensor], directions: Tensors, buffers: list[torch.Tensor],
               group: dict[str, Any]) -> None:
        """Momentum as ``torch.optim.SGD``'s (no dampening), then ``w -= lr * step``; the rate multiplies
        alike whether it is a number or a tensor, so both give the same bits."""
        momentum = group["momentum"]
        if momentum != 0:
            foreach("mul_")(buffers, momentum)
            foreach("add_")(buffers, directions)
            directions = foreach("add")(directions, buffers, alpha=momentum) if group["nesterov"] else buffers
        foreach("sub_")(params, foreach("mul")(directions, group["lr"]))


def check_settings(group: dict[str, Any]) -> None:
    """Refuse a group's settings that make no LARS step, in one line naming the setting."""
    lr = group["lr"]
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1:
            raise ConfigError("lr", f"must be a number or a 0-d tensor (got a tensor of shape {list(lr.shape)})")
    elif not lr >= 0:
        raise ConfigError("lr", f"must be at least 0 (got {lr})")
    if not group["trust"] > 0:
        raise ConfigError("trust", f"must be positive: the trust coefficient eta scales each layer's rate "
                                   f"(got {group['trust']})")
    if not 0 <= group["momentum"] < 1:
        raise ConfigError("momentum", f"must be in [0, 1) (got {group['momentum']})")
    if not group["weight_decay"] >= 0:
        raise ConfigError("weight_decay", f"must be at least 0 (got {group['weight_decay']})")
    if group["nesterov"] and group["momentum"] == 0:
        raise ConfigError("nesterov", "needs a momentum above 0")
