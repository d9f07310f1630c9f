"""The model zoo: the networks of the four papers, in plain torch.nn (no torchvision).

``resnet18`` and ``resnet50`` have torchvision's module names, parameters and buffers, so that
``torchvision.models.resnet50(num_classes=N)`` loads their state dict as it is.

CIFAR-style models (``lenet``, ``resnet20/32/56``, ``vgg16``) suit small images
(32 px); ImageNet-style ones (``resnet18``, ``resnet50``, ``nin``,
``googlenet-bn``) suit 224 px but accept smaller ones (they end in global
average pooling) down to each spec's ``smallest_image`` (``nin``: 39 px).
The registry is an explicit dict, never discovered.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dimd.errors import DimdError


# ----------------------------------------------------------------------------- LeNet
class LeNet(nn.Module):
    """LeNet-5 with ReLU and max pooling; no batch norm (the S-SGD equivalence test uses it)."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 6, 5), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(6, 16, 5), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.AdaptiveAvgPool2d(5))
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(16 * 25, 120), nn.ReLU(inplace=True),
            nn.Linear(120, 84), nn.ReLU(inplace=True), nn.Linear(84, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


# ----------------------------------------------------------------------------- CIFAR ResNets
class CifarBasicBlock(nn.Module):
    """He et al.'s CIFAR block with the parameter-free shortcut (option A: stride + zero channels)."""

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.stride = stride
        self.pad = planes - inplanes

    def shortcut(self, x: torch.Tensor) -> torch.Tensor:
        if self.stride != 1:
            x = x[:, :, ::self.stride, ::self.stride]
        if self.pad:
            x = F.pad(x, (0, 0, 0, 0, self.pad // 2, self.pad - self.pad // 2))
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)), inplace=True)
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x), inplace=True)


class CifarResNet(nn.Module):
    """ResNet-(6n+2) for 32 px images: three stages of 16/32/64 channels."""

    def __init__(self, depth: int, num_classes: int = 10, zero_init_residual: bool = False) -> None:
        super().__init__()
        if (depth - 2) % 6:
            raise ValueError("CIFAR ResNet depth must be 6n+2")
        n = (depth - 2) // 6
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16),
                                  nn.ReLU(inplace=True))
        layers: list[CifarBasicBlock] = []
        inplanes = 16
        for planes, stride in ((16, 1), (32, 2), (64, 2)):
            for i in range(n):
                layers.append(CifarBasicBlock(inplanes, planes, stride if i == 0 else 1))
                inplanes = planes
        self.layers = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(64, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        if zero_init_residual:  # each block starts as the identity (Goyal et al.)
            for block in layers:
                nn.init.zeros_(block.bn2.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.layers(self.stem(x))), 1))


# ----------------------------------------------------------------------------- ImageNet ResNets
class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1,
                 downsample: nn.Module | None = None) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample

    def last_bn(self) -> nn.BatchNorm2d:
        return self.bn2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = F.relu(self.bn1(self.conv1(x)), inplace=True)
        return F.relu(self.bn2(self.conv2(out)) + identity, inplace=True)


class Bottleneck(nn.Module):
    """The ResNet-50 v1.5 bottleneck (stride on the 3x3 convolution, as Goyal et al.)."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1,
                 downsample: nn.Module | None = None) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * 4)
        self.downsample = downsample

    def last_bn(self) -> nn.BatchNorm2d:
        return self.bn3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = F.relu(self.bn1(self.conv1(x)), inplace=True)
        out = F.relu(self.bn2(self.conv2(out)), inplace=True)
        return F.relu(self.bn3(self.conv3(out)) + identity, inplace=True)


class ResNet(nn.Module):
    """ImageNet ResNet; ``zero_init_residual`` zeroes each block's last BN scale (Goyal et al.)."""

    def __init__(self, block: type[BasicBlock] | type[Bottleneck], layers: tuple[int, ...],
                 num_classes: int = 1000, zero_init_residual: bool = False) -> None:
        super().__init__()
        self.inplanes = 64
        # torchvision's module names, so that its resnet18/resnet50 load the state dict as it is (dimd export).
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.layer1 = self._stage(block, 64, layers[0], 1)
        self.layer2 = self._stage(block, 128, layers[1], 2)
        self.layer3 = self._stage(block, 256, layers[2], 2)
        self.layer4 = self._stage(block, 512, layers[3], 2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512 * block.expansion, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        if zero_init_residual:
            for m in self.modules():
                if isinstance(m, (BasicBlock, Bottleneck)):
                    nn.init.zeros_(m.last_bn().weight)

    def _stage(self, block, planes: int, blocks: int, stride: int) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(
                nn.Conv2d(self.inplanes, planes * block.expansion, 1, stride, bias=False),
                nn.BatchNorm2d(planes * block.expansion))
        layers = [block(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * block.expansion
        layers += [block(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


# ----------------------------------------------------------------------------- VGG-16 (CIFAR)
VGG16_CONFIG = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")


class VGG(nn.Module):
    """VGG-16 with batch norm, CIFAR variant: one 512-wide classifier after global pooling."""

    def __init__(self, num_classes: int = 10, config: tuple = VGG16_CONFIG) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        channels = 3
        for v in config:
            if v == "M":
                layers.append(nn.MaxPool2d(2, ceil_mode=True))
            else:
                layers += [nn.Conv2d(channels, v, 3, padding=1, bias=False), nn.BatchNorm2d(v),
                           nn.ReLU(inplace=True)]
                channels = v
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Dropout(0.5), nn.Linear(512, 512), nn.ReLU(inplace=True),
                                        nn.Dropout(0.5), nn.Linear(512, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.pool(self.features(x)), 1))


# ----------------------------------------------------------------------------- Network in Network
def _mlpconv(cin: int, cout: int, kernel: int, stride: int, padding: int) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, kernel, stride, padding), nn.ReLU(inplace=True),
            nn.Conv2d(cout, cout, 1), nn.ReLU(inplace=True),
            nn.Conv2d(cout, cout, 1), nn.ReLU(inplace=True)]


class NiN(nn.Module):
    """Network in Network (Lin et al.), the ImageNet model FireCaffe trained.

    Weights ~ N(0, 0.01) for 1x1 and N(0, 0.05) for larger kernels, biases 0,
    as FireCaffe's section 7 reports. Pools use Caffe's ceil mode.
    """

    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        self.features = nn.Sequential(
            *_mlpconv(3, 96, 11, 4, 0), nn.MaxPool2d(3, 2, ceil_mode=True),
            *_mlpconv(96, 256, 5, 1, 2), nn.MaxPool2d(3, 2, ceil_mode=True),
            *_mlpconv(256, 384, 3, 1, 1), nn.MaxPool2d(3, 2, ceil_mode=True), nn.Dropout(0.5),
            nn.Conv2d(384, 1024, 3, 1, 1), nn.ReLU(inplace=True),
            nn.Conv2d(1024, 1024, 1), nn.ReLU(inplace=True),
            nn.Conv2d(1024, num_classes, 1), nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(1), nn.Flatten())
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.normal_(m.weight, 0.0, 0.01 if m.kernel_size == (1, 1) else 0.05)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.features(x)


# ----------------------------------------------------------------------------- GoogLeNet-BN
class ConvBN(nn.Sequential):
    def __init__(self, cin: int, cout: int, kernel: int, stride: int = 1, padding: int = 0) -> None:
        super().__init__(nn.Conv2d(cin, cout, kernel, stride, padding, bias=False),
                         nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class Inception(nn.Module):
    """GoogLeNet's four-branch module, every convolution followed by batch norm."""

    def __init__(self, cin: int, c1: int, c3r: int, c3: int, c5r: int, c5: int, pool: int) -> None:
        super().__init__()
        self.branch1 = ConvBN(cin, c1, 1)
        self.branch3 = nn.Sequential(ConvBN(cin, c3r, 1), ConvBN(c3r, c3, 3, padding=1))
        self.branch5 = nn.Sequential(ConvBN(cin, c5r, 1), ConvBN(c5r, c5, 3, padding=1))
        self.branch_pool = nn.Sequential(nn.MaxPool2d(3, 1, 1), ConvBN(cin, pool, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.branch1(x), self.branch3(x), self.branch5(x), self.branch_pool(x)], 1)


class GoogLeNetBN(nn.Module):
    """GoogLeNet (Szegedy et al.) with batch norm after each convolution, no auxiliary heads.

    The "5x5" branch uses a 3x3 convolution, as the batch-normalised variants
    (Torch's and torchvision's) do. The DIMD paper trains this model.
    """

    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            ConvBN(3, 64, 7, 2, 3), nn.MaxPool2d(3, 2, ceil_mode=True),
            ConvBN(64, 64, 1), ConvBN(64, 192, 3, padding=1), nn.MaxPool2d(3, 2, ceil_mode=True))
        self.blocks = nn.Sequential(
            Inception(192, 64, 96, 128, 16, 32, 32), Inception(256, 128, 128, 192, 32, 96, 64),
            nn.MaxPool2d(3, 2, ceil_mode=True),
            Inception(480, 192, 96, 208, 16, 48, 64), Inception(512, 160, 112, 224, 24, 64, 64),
            Inception(512, 128, 128, 256, 24, 64, 64), Inception(512, 112, 144, 288, 32, 64, 64),
            Inception(528, 256, 160, 320, 32, 128, 128), nn.MaxPool2d(2, 2, ceil_mode=True),
            Inception(832, 256, 160, 320, 32, 128, 128), Inception(832, 384, 192, 384, 48, 128, 128))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.dropout = nn.Dropout(0.2)
        self.fc = nn.Linear(1024, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.blocks(self.stem(x)))
        return self.fc(self.dropout(torch.flatten(x, 1)))


# ----------------------------------------------------------------------------- the registry
@dataclass(frozen=True)
class ModelSpec:
    name: str
    build: Callable[..., nn.Module]
    image_size: int          # the size it is designed for
    description: str
    has_batch_norm: bool = True
    smallest_image: int = 8  # below it a pooling stage has no pixel left (found by building each model)
    torchvision: str | None = None   # torchvision's builder whose state dict this model's is, key for key


MODELS: dict[str, ModelSpec] = {spec.name: spec for spec in (
    ModelSpec("lenet", lambda c, **_: LeNet(c), 32, "LeNet-5 (ReLU, max pool), no batch norm", False, 16),
    ModelSpec("resnet20", lambda c, zero_init_residual=False: CifarResNet(20, c, zero_init_residual),
              32, "CIFAR ResNet-20 (He et al.)"),
    ModelSpec("resnet32", lambda c, zero_init_residual=False: CifarResNet(32, c, zero_init_residual),
              32, "CIFAR ResNet-32 (He et al.)"),
    ModelSpec("resnet56", lambda c, zero_init_residual=False: CifarResNet(56, c, zero_init_residual),
              32, "CIFAR ResNet-56 (He et al.)"),
    ModelSpec("resnet18", lambda c, zero_init_residual=False: ResNet(BasicBlock, (2, 2, 2, 2), c,
                                                                     zero_init_residual),
              224, "ImageNet ResNet-18", torchvision="resnet18"),
    ModelSpec("resnet50", lambda c, zero_init_residual=False: ResNet(Bottleneck, (3, 4, 6, 3), c,
                                                                     zero_init_residual),
              224, "ImageNet ResNet-50 v1.5 (DIMD, Goyal et al.)", torchvision="resnet50"),
    ModelSpec("vgg16", lambda c, **_: VGG(c), 32, "VGG-16 with batch norm, CIFAR variant"),
    ModelSpec("nin", lambda c, **_: NiN(c), 224, "Network in Network (FireCaffe)", False, 39),
    ModelSpec("googlenet-bn", lambda c, **_: GoogLeNetBN(c), 224,
              "GoogLeNet with batch norm (DIMD, FireCaffe)", smallest_image=15),
)}


def image_size_problem(model: str, image_size: int) -> str | None:
    """Why ``model`` cannot take ``image_size`` px, or None (a user's own model is not checked)."""
    spec = MODELS.get(model)
    if spec is None or image_size >= spec.smallest_image:
        return None
    return f"must be at least {spec.smallest_image} for {model} (got {image_size}): its pooling leaves no pixel"


def _unknown(name: str) -> str:
    return (f"unknown model {name!r}; choose from {', '.join(MODELS)}, or name your own as "
            f"package.module:callable or path/to/file.py:callable")


def model_problem(name: str) -> str | None:
    """Why ``name`` names no model (one line), or None; a user's callable is imported but not called,
    since the class count it must be called with is the data's, known only once the data is read."""
    from dimd.train.model_source import is_model_spec, model_callable

    if not is_model_spec(name):
        return None if name in MODELS else _unknown(name)
    try:
        model_callable(name)
    except DimdError as exc:
        return str(exc)
    return None


def build_model(name: str, num_classes: int, *, zero_init_residual: bool = False) -> nn.Module:
    """A freshly initialised model from the registry, or a user's (``module:callable``, ``file.py:callable``,
    see :mod:`dimd.train.model_source`); a clear error for an unknown name."""
    from dimd.train.model_source import build_user_model, is_model_spec

    if is_model_spec(name):
        return build_user_model(name, num_classes)
    spec = MODELS.get(name)
    if spec is None:
        raise DimdError(_unknown(name))
    return spec.build(num_classes, zero_init_residual=zero_init_residual)


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def gradient_bytes(model: nn.Module) -> int:
    """Bytes one allreduce moves per step: every trainable parameter's gradient."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
