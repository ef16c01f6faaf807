"""ResNet-50 in plain torch, for bench/resnet_step.py where torchvision is missing:
torchvision's resnet50 (v1.5: the stride on the 3x3 convolution), Bottleneck blocks
[3, 4, 6, 3], 1000 classes, its parameter names and its initialization."""
import torch
from torch import nn


class Bottleneck(nn.Module):
    """1x1, 3x3 and 1x1 convolutions, each with batch norm, added to the input (through a 1x1
    convolution and batch norm where the shape changes)."""

    def __init__(self, channels, width, stride):
        super().__init__()
        out = 4 * width
        self.conv1 = nn.Conv2d(channels, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or channels != out:
            self.downsample = nn.Sequential(nn.Conv2d(channels, out, 1, stride, bias=False), nn.BatchNorm2d(out))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.relu(self.bn2(self.conv2(y)))
        return self.relu(self.bn3(self.conv3(y)) + identity)


class ResNet50(nn.Module):
    def __init__(self, classes=1000):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, padding=1)
        channels = 64
        for index, (width, blocks, stride) in enumerate(zip((64, 128, 256, 512), (3, 4, 6, 3), (1, 2, 2, 2)), 1):
            layer = []
            for block in range(blocks):
                layer.append(Bottleneck(channels, width, stride if block == 0 else 1))
                channels = 4 * width
            setattr(self, f"layer{index}", nn.Sequential(*layer))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(module, nn.BatchNorm2d):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))
