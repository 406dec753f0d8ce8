"""Stand-ins for tensors in host-side rule checks that must not need a GPU."""

from __future__ import annotations


class OnGPU:
    """A CUDA tensor as the Gluon backends' rules see it: they read dtype, dim() and is_cuda only."""

    def __init__(self, dtype, dim: int, shape: tuple | None = None):
        self.dtype, self._dim, self.is_cuda = dtype, dim, True
        if shape is not None:  # for rules that read head dims
            assert len(shape) == dim
            self.shape = tuple(shape)

    def dim(self) -> int:
        return self._dim
