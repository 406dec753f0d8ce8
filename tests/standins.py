"""Stand-ins for tensors in host-side rule checks that must not need a GPU."""

from __future__ import annotations

import torch


class OnGPU:
    """A CUDA tensor (or, is_cuda False, a CPU one) as the Gluon backends' rules see it: dtype, dim(),
    is_cuda, and where given shape and is_contiguous()."""

    def __init__(self, dtype, dim: int, shape: tuple | None = None, contiguous: bool = True, is_cuda: bool = True,
                 data_ptr: int = 1024):
        self.dtype, self._dim, self.is_cuda, self._contiguous = dtype, dim, is_cuda, contiguous
        self._data_ptr = data_ptr  # for rules that check TMA's 16-byte alignment
        if shape is not None:  # for rules that read head dims
            assert len(shape) == dim
            self.shape = torch.Size(shape)

    def is_contiguous(self) -> bool:
        return self._contiguous

    def dim(self) -> int:
        return self._dim

    def data_ptr(self) -> int:
        return self._data_ptr


def operand(shape, dtype, is_cuda: bool = True, contiguous: bool = True, data_ptr: int = 1024) -> OnGPU:
    """An `OnGPU` of this shape (a rule's view of a tensor: shape, dtype, is_cuda, is_contiguous(),
    dim(), data_ptr())."""
    return OnGPU(dtype, len(shape), tuple(shape), contiguous, is_cuda, data_ptr)


class LaunchSpy:
    """Stands in for a Gluon kernel in its module: records each launch's grid and keyword arguments
    (`grids`, `kwargs`) and launches."""

    def __init__(self, kernel):
        self.kernel, self.grids, self.kwargs = kernel, [], []

    def __getitem__(self, grid):
        self.grids.append(grid)
        launch = self.kernel[grid]

        def record(*args, **kwargs):
            self.kwargs.append(kwargs)
            return launch(*args, **kwargs)

        return record


def spy_on_kernels(monkeypatch, module, names, **switches) -> list:
    """Set a Gluon kernel module's switches (name=value) and stand a `LaunchSpy` in for each of its
    kernels named in `names`; the spies, in that order."""
    for name, value in switches.items():
        monkeypatch.setattr(module, name, value)
    spies = [LaunchSpy(getattr(module, name)) for name in names]
    for name, spy in zip(names, spies):
        monkeypatch.setattr(module, name, spy)
    return spies
