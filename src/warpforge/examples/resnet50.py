"""ResNet-50 (warpforge's model zoo architecture, torchvision's layout) trained on random images.

``factory(size="tiny" | "small" | "full")``: ``tiny`` is batch 2 at 64x64 (CPU), ``small`` batch 32 at
224x224, ``full`` batch 128 at 224x224 (bf16 autocast on a GPU in both).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from warpforge.examples import pick
from warpforge.profile.train import TrainSetup


@dataclass(frozen=True)
class ResNetConfig:
    batch: int
    image: int
    batches: int = 16  # distinct random batches the loader cycles through

    def __post_init__(self) -> None:
        if self.batch < 1 or self.image < 32:
            raise ValueError(f"batch must be >= 1 and image >= 32, got batch={self.batch}, image={self.image}")


SIZES = {"tiny": ResNetConfig(batch=2, image=64, batches=4), "small": ResNetConfig(batch=32, image=224),
         "full": ResNetConfig(batch=128, image=224)}


class RandomImages(torch.utils.data.Dataset):
    """(image [3, S, S], label) pairs, fixed by the seed."""

    def __init__(self, n: int, image: int, classes: int = 1000, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.images = torch.randn(n, 3, image, image, generator=g)
        self.labels = torch.randint(0, classes, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[i], self.labels[i]


def factory(size: str | None = None, device: torch.device | str | None = None) -> TrainSetup:
    from warpforge.zoo.resnet import ResNet

    device, size, c = pick(size, device, SIZES)
    torch.manual_seed(0)
    cuda = device.type == "cuda"
    model = ResNet().to(device, memory_format=torch.channels_last if cuda else torch.contiguous_format)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=True)
    loader = torch.utils.data.DataLoader(RandomImages(c.batch * c.batches, c.image), batch_size=c.batch,
                                         shuffle=True, drop_last=True, pin_memory=cuda)

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:  # [B, 1000], [B]
        return nn.functional.cross_entropy(logits.float(), labels)

    if not cuda:
        return TrainSetup(loader=loader, model=model, optimizer=opt, loss_fn=loss_fn, device=device,
                          name=f"resnet50 ({size})")

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        images, labels = batch
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(images.contiguous(memory_format=torch.channels_last))
        loss_fn(logits, labels).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return TrainSetup(loader=loader, model=model, optimizer=opt, step=step, device=device, name=f"resnet50 ({size})")
