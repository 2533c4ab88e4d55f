"""A checkpoint's tensors, read from safetensors only when asked: whole, a tensor-parallel
rank's slice, or rows of a fused tensor."""

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from engine.layers.linear import ShardSlice
from engine.model_loader.folder import ModelLoadError


class CheckpointTensor:
    """A tensor of an open safetensors file, read only when asked: whole, or the slice a
    tensor-parallel rank holds (so no rank reads the whole checkpoint into memory)."""

    def __init__(self, reader: Any, name: str) -> None:
        self._reader = reader
        self._name = name
        self.shape = tuple(reader.get_slice(name).get_shape())

    def read(self, piece: ShardSlice | None = None) -> torch.Tensor:
        """The tensor, or its slice `piece`."""
        if piece is None:
            return self._reader.get_tensor(self._name)
        index = [slice(None)] * len(self.shape)
        index[piece.dim] = slice(piece.start, piece.start + piece.length)
        return self.read_region(tuple(index))

    def read_region(self, index: tuple[slice, ...]) -> torch.Tensor:
        """The part of the tensor `index` selects, reading nothing else."""
        return self._reader.get_slice(self._name)[index]

    def rows(self, start: int, length: int) -> "CheckpointRows":
        """Rows [start, start + length) of the tensor, as a tensor of their own (one of the
        projections a checkpoint stores fused, as Phi-3's qkv_proj)."""
        return CheckpointRows(self, start, length)


class CheckpointRows:
    """Rows of a `CheckpointTensor`, read only when asked, like it: of a tensor-parallel
    slice, only the slice's part of these rows is read."""

    def __init__(self, tensor: CheckpointTensor, start: int, length: int) -> None:
        self._tensor = tensor
        self._start = start
        self.shape = (length, *tensor.shape[1:])

    def read(self, piece: ShardSlice | None = None) -> torch.Tensor:
        """These rows, or their slice `piece`."""
        index = [slice(self._start, self._start + self.shape[0])] + [slice(None)] * (len(self.shape) - 1)
        if piece is not None:
            first = piece.start + (self._start if piece.dim == 0 else 0)
            index[piece.dim] = slice(first, first + piece.length)
        return self._tensor.read_region(tuple(index))


@contextmanager
def open_safetensors(files: list[Path]) -> Iterator[list[tuple[str, CheckpointTensor]]]:
    """Every tensor in the files, to be read while the files are open (until the block
    ends: a quantized projection's parts may lie in several); a damaged file raises
    ModelLoadError naming it."""
    with ExitStack() as files_open:
        tensors = []
        for file in files:
            try:
                reader = files_open.enter_context(safe_open(file, framework="pt"))
                tensors += [(name, CheckpointTensor(reader, name)) for name in reader.keys()]
            except Exception as exc:  # safetensors raises several types for a damaged file
                raise ModelLoadError(
                    f"weight file {file} could not be read ({exc}); it may be truncated or "
                    f"corrupt: copy or convert it again"
                ) from exc
        yield tensors
