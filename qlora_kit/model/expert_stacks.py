"""Model stage: one stack of a mixture's expert weights packed in 4 bits, an expert at a time, and unpacked.

``moe_experts.py`` packs the 3-D stacks transformers declares (``use_experts_implementation``),
``moe_flat.py`` the 2-D ones of a mixture that keeps its experts as one (experts x rows, columns) matrix
(DBRX's ``w1``/``v1``/``w2``); both hold the packed stack as the parameter it replaces (experts x values/2,
uint8) and its statistics beside it (``<name>_4bit``: ``ExpertStats``).
"""

from __future__ import annotations

import bitsandbytes.functional as bnbf
import torch

from qlora_kit.errors import RecipeError

BLOCKSIZE = 64  # bitsandbytes' 4-bit block, as for Linear4bit


def pack_stack(
    experts,
    name: str,
    weight: torch.Tensor,
    transposed: bool,
    compute_dtype: torch.dtype,
    quant_type: str,
    double_quant: bool,
    flat: bool = False,
) -> None:
    """Replace the parameter ``name`` of ``experts`` with ``weight`` (E, O, I), or (E, I, O) when
    ``transposed``, packed in 4 bits (``quant_type``, its statistics quantized again with ``double_quant``)
    from ``compute_dtype``, and its statistics beside it (``flat``: the parameter was stored as
    (E*rows, columns), which unpacking gives back)."""
    if weight.shape[1] * weight.shape[2] % BLOCKSIZE:
        raise RecipeError(
            f"model.path: an expert's {name} has {weight.shape[1]}x{weight.shape[2]} values, not a multiple "
            f"of the 4-bit block ({BLOCKSIZE})"
        )
    packed, states = [], []
    for e in range(weight.shape[0]):  # one expert at a time: the 16-bit copy never doubles
        data, state = bnbf.quantize_4bit(  # each expert (O, I), as matmul_4bit reads it
            (weight[e].t() if transposed else weight[e]).to(compute_dtype).contiguous(),
            blocksize=BLOCKSIZE,
            compress_statistics=double_quant,
            quant_type=quant_type,
            quant_storage=torch.uint8,
        )
        packed.append(data.view(-1))
        states.append(state)
    shape = (weight.shape[0], *states[0].shape)  # (E, O, I) whichever way the stack was stored
    del weight
    setattr(experts, name, torch.nn.Parameter(torch.stack(packed), requires_grad=False))
    experts.add_module(f"{name}_4bit", ExpertStats(states, shape, compute_dtype, transposed, flat))


def unpack_stack(experts, name: str) -> bool:
    """The packed stack ``name`` back into its parameter, in the storage layout and compute dtype it was
    packed from; False where it is not packed."""
    stats = getattr(experts, f"{name}_4bit", None)
    if stats is None:
        return False
    packed = getattr(experts, name)
    weight = torch.stack([bnbf.dequantize_4bit(packed[e], stats.state(e)) for e in range(stats.shape[0])])
    if stats.transposed:
        weight = weight.transpose(1, 2)  # back to the stored (experts, in, out)
    if stats.flat:
        weight = weight.reshape(-1, weight.shape[-1])  # back to (experts x rows, columns)
    setattr(experts, name, torch.nn.Parameter(weight.to(stats.dtype).contiguous(), requires_grad=False))
    delattr(experts, f"{name}_4bit")
    return True


class ExpertStats(torch.nn.Module):
    """The 4-bit statistics of one packed expert stack: per-expert absmax (8-bit with double
    quantization, then with their own absmax and offset), the code books, the logical shape (experts, out, in),
    whether the stack was stored transposed (experts, in, out), and whether it was stored flat (experts x
    rows, columns)."""

    def __init__(
        self,
        states: list,
        shape: tuple[int, int, int],
        dtype: torch.dtype,
        transposed: bool = False,
        flat: bool = False,
    ) -> None:
        super().__init__()
        first = states[0]
        self.shape, self.dtype, self.transposed, self.flat = shape, dtype, transposed, flat
        self.quant_type, self.blocksize, self.nested = first.quant_type, first.blocksize, first.nested
        self.register_buffer("absmax", torch.stack([s.absmax for s in states]))
        self.register_buffer("code", first.code)
        if self.nested:
            self.register_buffer("absmax2", torch.stack([s.state2.absmax for s in states]))
            self.register_buffer("offset", torch.stack([s.offset.reshape(()) for s in states]))
            self.register_buffer("code2", first.state2.code)
            self.blocksize2 = first.state2.blocksize

    def state(self, expert: int) -> bnbf.QuantState:
        """bitsandbytes' QuantState of one expert: views of the stacked statistics, nothing copied."""
        nested = None
        if self.nested:
            nested = bnbf.QuantState(
                absmax=self.absmax2[expert], code=self.code2, blocksize=self.blocksize2, dtype=torch.float32
            )
        return bnbf.QuantState(
            absmax=self.absmax[expert],
            shape=self.shape[1:],
            code=self.code,
            blocksize=self.blocksize,
            quant_type=self.quant_type,
            dtype=self.dtype,
            offset=self.offset[expert] if self.nested else None,
            state2=nested,
        )
