"""The MLP's activation without adapters: act = silu(gate) * up, in one pass and one rounding.

torch's `F.silu(gate) * up` is two kernels over [T, intermediate] with a rounded intermediate between
them; this is one read of gate|up and one write of act (H200, Llama-3-8B width, bf16: 29.2 us against
torch's 85.9 at T=1024, floor 20.7; 6.5 against 10.9 at T=64; bench/results/
kernels_activation_20261130_h200.json). The result is computed in float32 and rounded once, as the
folded LoRA activation (`kernels.lora.lora_silu_mul`) computes it for adapted tokens (whose gate and
up it takes in float32, delta added: unfolded, they reach this kernel rounded to the model dtype).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from lorafleet.kernels.lora import resolve_backend


@triton.jit
def silu_mul_kernel(
    gate_up_ptr,  # [T, 2 * I] model dtype: gate columns, then up columns
    out_ptr,  # [T, I] model dtype
    num_tokens,
    inter,
    stride_gt,
    stride_ot,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_t < num_tokens)[:, None] & (offs_n < inter)[None, :]
    rows = offs_t.to(tl.int64)[:, None]
    g = tl.load(gate_up_ptr + rows * stride_gt + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate_up_ptr + rows * stride_gt + inter + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows * stride_ot + offs_n[None, :], (g * tl.sigmoid(g) * u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: Tensor, *, out: Tensor | None = None, backend: str = "auto") -> Tensor:
    """silu(gate) * up of a gate|up GEMM's output, computed in float32 and rounded once.

    Semantics: out[t, n] = silu(g[t, n]) * u[t, n] with g = gate_up[:, :I], u = gate_up[:, I:].

    gate_up: [T, 2 * I] float32/float16/bfloat16, contiguous last dim. out: [T, I], gate_up's dtype and
    device, contiguous last dim (None: a new tensor). backend: "reference" (torch), "triton", or
    "auto" (Triton on CUDA). Returns out.
    """
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"silu_mul: gate_up must be [T, 2 * I] with a contiguous last dim, got shape {tuple(gate_up.shape)} strides {gate_up.stride()}")
    if gate_up.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"silu_mul: gate_up must be float32, float16 or bfloat16, got {gate_up.dtype}")
    num_tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    if out is None:
        out = torch.empty(num_tokens, inter, dtype=gate_up.dtype, device=gate_up.device)
    elif tuple(out.shape) != (num_tokens, inter) or out.dtype != gate_up.dtype or out.device != gate_up.device or out.stride(1) != 1:
        raise ValueError(f"silu_mul: out must be [T={num_tokens}, I={inter}] {gate_up.dtype} on {gate_up.device} with a contiguous last dim, "
                         f"got {tuple(out.shape)} {out.dtype} on {out.device}")  # fmt: skip
    backend = resolve_backend(backend, gate_up.device, gate_up.dtype)
    if num_tokens == 0 or inter == 0:
        return out
    if backend == "reference":
        out.copy_(F.silu(gate_up[:, :inter].float()) * gate_up[:, inter:].float())
        return out
    block_t = min(16, triton.next_power_of_2(num_tokens))
    block_n = min(256, triton.next_power_of_2(inter))
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(inter, block_n))
    silu_mul_kernel[grid](gate_up, out, num_tokens, inter, gate_up.stride(0), out.stride(0), BLOCK_T=block_t, BLOCK_N=block_n, num_warps=4)
    return out
