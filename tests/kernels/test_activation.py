"""silu_mul (the MLP activation without adapters: float32, one rounding) on both backends (Triton
through its interpreter on CPU; on a GPU with the gpu marker) against a float64 answer, and its checks."""

import pytest
import torch
import torch.nn.functional as F

from lorafleet.kernels.activation import silu_mul

TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def _want(gate_up: torch.Tensor) -> torch.Tensor:
    g, u = gate_up.double().chunk(2, dim=-1)
    return F.silu(g) * u


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(1, 16), (7, 80), (37, 300), (0, 64)])
def test_silu_mul_matches_float64(backend, dtype, shape, gen):
    num_tokens, inter = shape
    gate_up = (torch.randn(num_tokens, 2 * inter, generator=gen) * 4).to(dtype)
    out = torch.full((num_tokens, inter), float("nan"), dtype=dtype)  # poisoned: every element must be written
    assert silu_mul(gate_up, out=out, backend=backend) is out
    want = _want(gate_up)
    assert not torch.isnan(out).any()
    if num_tokens:
        assert float((out.double() - want).abs().max()) <= TOL[dtype] * max(1.0, float(want.abs().max()))
    # Rounded once: the float32 product rounded to the dtype, exactly (torch's own silu(gate) * up in a 16-bit
    # dtype rounds twice and differs; Triton's interpreter computes bfloat16 casts otherwise, hence no bf16 here).
    if backend == "reference" or dtype == torch.float16:
        g, u = gate_up.float().chunk(2, dim=-1)
        assert torch.equal(out, (F.silu(g) * u).to(dtype))


def test_silu_mul_takes_row_strided_views_and_allocates(gen):
    big = torch.randn(9, 2 * 48 + 8, generator=gen)
    gate_up = big[:, : 2 * 48]  # rows strided, last dim contiguous
    for backend in ("reference", "triton"):
        out = silu_mul(gate_up, backend=backend)
        assert out.shape == (9, 48) and out.dtype == gate_up.dtype
        torch.testing.assert_close(out.double(), _want(gate_up), rtol=1e-5, atol=1e-6)


def test_silu_mul_checks_its_inputs():
    with pytest.raises(ValueError, match=r"\[T, 2 \* I\]"):
        silu_mul(torch.zeros(4, 7))
    with pytest.raises(ValueError, match="contiguous last dim"):
        silu_mul(torch.zeros(8, 4).t())
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        silu_mul(torch.zeros(4, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="out must be"):
        silu_mul(torch.zeros(4, 8), out=torch.zeros(4, 5))
    with pytest.raises(ValueError, match="out must be"):
        silu_mul(torch.zeros(4, 8), out=torch.zeros(4, 4, dtype=torch.float16))
    with pytest.raises(ValueError, match="backend"):
        silu_mul(torch.zeros(4, 8), backend="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 64, 1024])
def test_silu_mul_on_gpu_at_llama_width(num_tokens, gen):
    gate_up = (torch.randn(num_tokens, 2 * 14336, generator=gen) * 4).to(device="cuda", dtype=torch.bfloat16)
    out = torch.full((num_tokens, 14336), float("nan"), dtype=torch.bfloat16, device="cuda")
    silu_mul(gate_up, out=out)
    want = _want(gate_up.cpu())
    assert not torch.isnan(out).any()
    assert float((out.double().cpu() - want).abs().max()) <= TOL[torch.bfloat16] * float(want.abs().max())
    g, u = gate_up.float().chunk(2, dim=-1)
    once = (F.silu(g) * u).to(torch.bfloat16)  # torch in float32, rounded once: at most an ulp apart (sigmoid's last bit)
    assert float((out != once).float().mean()) < 0.01
