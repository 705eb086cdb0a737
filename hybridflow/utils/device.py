"""Host → GPU copies that do not stall the host.

A plain `.to("cuda")` of pageable memory waits for the stream to drain, so the GPU idles while Python prepares the
next launch. Copying from pinned memory with `non_blocking=True` queues the copy behind the running kernels instead
(torch's caching host allocator keeps the pinned block alive until the copy is done).
"""

from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    device = torch.device(device)
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
