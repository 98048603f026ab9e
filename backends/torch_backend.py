"""PyTorch backend (CPU or CUDA).  Plain tensors only: nothing here, or in the layers, asks for
autograd -- every gradient is computed by pycapsnet's hand-written backward."""
from __future__ import annotations

import os

import numpy as np

from .base import Backend, BackendError


class TorchBackend(Backend):
    name = "torch"

    def __init__(self, dtype: str = "float32", device: str = "cpu"):
        # Large CPU tensors (the im2col matrix is ~190 MB at batch 64) on transparent huge pages:
        # 2-3x faster to fill than on 4 KB pages.  NumPy does this by default; PyTorch reads this
        # switch when its allocator starts, so it only helps if torch was not used before.
        os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
        try:
            import torch
        except ImportError as e:
            raise BackendError("the torch backend needs PyTorch, which is not installed: "
                               "pip install 'pycapsnet[torch]' (or pip install torch)") from e
        super().__init__(dtype, device or "cpu")
        dev = str(self.device)
        if dev.startswith("cuda"):
            if not torch.cuda.is_available():
                raise BackendError(f"device {dev!r} asked for, but torch.cuda.is_available() is False "
                                   "(no CUDA GPU or a CPU-only PyTorch build); use device='cpu'")
        elif dev != "cpu":
            raise BackendError(f"unknown torch device {dev!r}: use 'cpu', 'cuda' or 'cuda:N'")
        import array_api_compat.torch as xp

        self.torch = torch
        self.xp = xp
        self._device = torch.device(dev)
        if self._device.type == "cuda" and self._device.index is None:
            self._device = torch.device("cuda", torch.cuda.current_device())
        self.device = str(self._device)
        if self._device.type == "cpu":
            # col2im's strided adds are memory-bound and run best split over the batch
            self.threads = max(1, min(4, os.cpu_count() or 1))

    def _float(self, dtype=None):
        return getattr(self.torch, dtype or self.dtype)

    def _device_kw(self):
        return {"device": self._device}

    def asarray(self, a, dtype=None):
        t = self.torch
        if isinstance(a, t.Tensor):
            x = a.to(self._device)
        else:
            x = t.as_tensor(np.asarray(a), device=self._device)
        if x.is_floating_point() or dtype is not None:
            x = x.to(self._float(dtype))
        return x

    def to_numpy(self, x) -> np.ndarray:
        return x.detach().cpu().numpy()

    def einsum(self, subscripts, *operands):
        return self.torch.einsum(subscripts, *operands)

    def windows(self, x, kh, kw, stride):
        # unfold(dim, size, step) appends the window axis: (N, OH, OW, C, kh, kw) -> (N, OH, OW, kh, kw, C)
        return x.unfold(1, kh, stride).unfold(2, kw, stride).permute(0, 1, 2, 4, 5, 3)

    def synchronize(self) -> None:
        if self._device.type == "cuda":
            self.torch.cuda.synchronize(self._device)

    def memory(self) -> dict:
        if self._device.type == "cuda":
            c = self.torch.cuda
            return {"current": c.memory_allocated(self._device), "peak": c.max_memory_allocated(self._device),
                    "kind": "torch CUDA allocator"}
        return super().memory()

    def reset_peak_memory(self) -> None:
        if self._device.type == "cuda":
            self.torch.cuda.reset_peak_memory_stats(self._device)
        else:
            super().reset_peak_memory()
