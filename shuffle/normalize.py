"""The data path's last stage: uint8 batches -> normalised float32 on the device.

The decoding workers hand over uint8 ``N x 3 x H x W`` batches (a quarter of
the bytes of float32 in the ring, over PCIe and in the device feed); the
conversion to float and the normalisation happen once, on the device, just
before the forward pass.
"""

from __future__ import annotations

import torch

#: ImageNet's per-channel mean and standard deviation (0..255 scale), as the ResNet recipe uses.
MEAN = (0.485 * 255, 0.456 * 255, 0.406 * 255)
STD = (0.229 * 255, 0.224 * 255, 0.225 * 255)


class Normalize:
    """uint8 N x 3 x H x W images -> normalised float32 on the device, in one pass (in ``memory_format``:
    channels-last is made from the uint8 batch, a quarter of the bytes of the float one)."""

    def __init__(self, device: torch.device, memory_format: torch.memory_format = torch.contiguous_format) -> None:
        self.device = device
        self.memory_format = memory_format
        self.mean = torch.tensor(MEAN, device=device).view(1, 3, 1, 1)
        self.inv_std = (1.0 / torch.tensor(STD, device=device)).view(1, 3, 1, 1)

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        x = images.to(self.device, non_blocking=True).contiguous(memory_format=self.memory_format).float()
        return x.sub_(self.mean).mul_(self.inv_std)
