"""Stand-ins for tensors in host-side rule checks that must not need a GPU."""

from __future__ import annotations


class OnGPU:
    """A CUDA tensor as the Gluon backends' rules see it: they read dtype, dim() and is_cuda only."""

    def __init__(self, dtype, dim: int):
        self.dtype, self._dim, self.is_cuda = dtype, dim, True

    def dim(self) -> int:
        return self._dim
