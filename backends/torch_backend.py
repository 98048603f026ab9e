"""PyTorch backend (CPU or CUDA).  Plain tensors only: nothing here, or in the layers, asks for
autograd -- every gradient is computed by pycapsnet's hand-written backward."""
from __future__ import annotations

import os

import numpy as np

from .base import Backend, BackendError, keep_freed_memory, parse_einsum_pair, stacked_outer_form


def is_torch_device(name: str) -> bool:
    """'cpu', 'cuda' or 'cuda:N': the devices this backend (and the benchmark's autograd reference) run on."""
    return name in ("cpu", "cuda") or (name.startswith("cuda:") and name[5:].isdigit())


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
        if not is_torch_device(dev):
            raise BackendError(f"unknown torch device {dev!r}: use 'cpu', 'cuda' or 'cuda:N'")
        if dev != "cpu" and not torch.cuda.is_available():
            raise BackendError(f"device {dev!r} asked for, but torch.cuda.is_available() is False "
                               "(no CUDA GPU or a CPU-only PyTorch build); use device='cpu'")
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
            self.elementwise_block = 1 << 20  # as NumPy's: a block's temporaries stay in cache
            keep_freed_memory()  # PyTorch's CPU allocator is glibc's malloc: same reasoning as NumPy
        else:
            # A step is hundreds of small kernels: on a GPU, launching them costs more than running
            # them.  A CUDA graph launches them all at once (H100, batch 64: 7.8 -> 4.2 ms per step).
            self.can_capture = True

    def _float(self, dtype=None):
        return getattr(self.torch, dtype or self.dtype)

    def _device_kw(self):
        return {"device": self._device}

    def asarray(self, a, dtype=None):
        t = self.torch
        if isinstance(a, t.Tensor):
            x = a.to(self._device)
        else:
            self._check_host_transfer("a host-to-device copy")
            x = t.as_tensor(np.asarray(a), device=self._device)
        if x.is_floating_point() or dtype is not None:
            x = x.to(self._float(dtype))
        return x

    def to_numpy(self, x) -> np.ndarray:
        self._check_host_transfer("reading an array on the host")
        return x.detach().cpu().numpy()

    def capture(self, fn):
        """On CUDA: a CUDA graph of ``fn`` (torch.cuda.CUDAGraph), replayed with one launch.  ``fn``
        runs twice first on a side stream, as PyTorch asks (cuBLAS handles, lazily built constants,
        allocator state), the second time with host transfers refused; the graph's temporaries live
        in its own memory pool for as long as the graph does."""
        if self._device.type != "cuda":
            return super().capture(fn)
        torch = self.torch
        side = torch.cuda.Stream(self._device)
        side.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(side):
            fn()
            with self.host_transfers_refused():
                fn()
        torch.cuda.current_stream(self._device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with self.host_transfers_refused(), torch.cuda.graph(graph):
            fn()
        return graph.replay

    def einsum(self, subscripts, *operands):
        if len(operands) == 2:
            out = _broadcast_contract(subscripts, *operands)
            if out is None:
                out = _stacked_outer_sum(subscripts, *operands)
            if out is not None:
                return out
        return self.torch.einsum(subscripts, *operands)

    def contiguous(self, x):
        return x.contiguous()

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


def _to_order(t, subs, order):
    """View ``t`` (indexed by ``subs``) in index order ``order``, with size-1 axes for absent indices."""
    present = [subs.index(c) for c in order if c in subs]
    shape = [t.shape[subs.index(c)] if c in subs else 1 for c in order]
    return t.permute(present).reshape(shape)


def _broadcast_contract(subscripts, a, b):
    """A two-operand einsum as broadcast multiply + sum, when that reads each element once: when the
    full product of the two operands is no larger than the bigger of them (every index of the small
    operand also indexes the big one, e.g. 'nji,injd->njd').  torch.einsum maps such contractions
    to bmm, which first copies the big operand into a batch-major layout; here it is read in place,
    2-3x faster for the routing sums.  Returns None when the rule does not apply."""
    parsed = parse_einsum_pair(subscripts)
    if parsed is None:
        return None
    sa, sb, out = parsed
    big, small, s_big, s_small = (a, b, sa, sb) if a.numel() >= b.numel() else (b, a, sb, sa)
    if not set(s_small) <= set(s_big) or not set(out) <= set(s_big):
        return None
    prod = big * _to_order(small, s_small, s_big)
    summed = [k for k, c in enumerate(s_big) if c not in out]
    if summed:
        prod = prod.sum(dim=summed)
    kept = [c for c in s_big if c in out]
    return prod.permute([kept.index(c) for c in out]).contiguous()  # C order, as the layers expect


def _stacked_outer_sum(subscripts, a, b):
    """'qA,qB->O' where every index of A and B appears in O and vice versa: a sum over q of outer
    products (the routing backward's 'qnji,qnjd->injd').  Accumulated in place slice by slice
    (addcmul_), 5x faster than torch.einsum, which builds it as a bmm into a transposed layout."""
    import torch

    form = stacked_outer_form(subscripts)
    if form is None:
        return None
    A, Bs, out = form
    size = {**dict(zip(A, a.shape[1:])), **dict(zip(Bs, b.shape[1:]))}
    # the result in C order: a product of permuted views would follow their memory order instead,
    # and the caller's reshape would then copy it
    acc = a.new_empty([size[c] for c in out])
    torch.mul(_to_order(a[0], A, out), _to_order(b[0], Bs, out), out=acc)
    for k in range(1, a.shape[0]):
        acc.addcmul_(_to_order(a[k], A, out), _to_order(b[k], Bs, out))
    return acc
