"""How AWQ and GPTQ checkpoints pack 4-bit values into int32 words, shared by the checkpoint
reader (`engine.quantization.checkpoint`) and the Triton W4A16 kernel."""

import torch


def unpack_int4(packed: torch.Tensor, dim: int, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """int32 words holding eight 4-bit values each -> uint8 values, eight per word along
    `dim`; nibble j of a word holds value `order[j]` of its eight."""
    shifts = torch.tensor([4 * order.index(i) for i in range(8)], dtype=torch.int32)
    words = packed.to(torch.int32).unsqueeze(-1 if dim == 1 else 1)
    shape = [1] * words.dim()
    shape[-1 if dim == 1 else 1] = 8
    values = (words >> shifts.view(shape)) & 0xF
    return values.flatten(1, 2) if dim == 1 else values.flatten(0, 1)
