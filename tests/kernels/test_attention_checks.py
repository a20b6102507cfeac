"""The paged-attention launchers refuse what the kernels would read or write wrongly: dtypes, shapes,
head_dim strides, index tensors' dtypes, lengths and strides, devices, scales."""

import pytest
import torch

from lorafleet.kernels.attention import paged_attention_decode, paged_attention_prefill, write_kv
from tests.kernels.kernel_cases import paged_caches

BACKENDS = ["reference", "triton"]


def test_attention_refuses_bad_inputs(gen):
    k_cache, v_cache = paged_caches(4, 4, 2, 16, torch.float32, gen)
    q = torch.randn(2, 4, 16)
    ok = dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=torch.zeros(2, 3, dtype=torch.int32), context_lens=torch.ones(2, dtype=torch.int32), scale=1.0, out=torch.empty_like(q))
    paged_attention_decode(**ok)
    with pytest.raises(ValueError, match="multiple"):
        paged_attention_decode(**{**ok, "q": torch.randn(2, 3, 16), "out": torch.empty(2, 3, 16)})
    with pytest.raises(ValueError, match="block_tables"):
        paged_attention_decode(**{**ok, "block_tables": torch.zeros(2, 3, dtype=torch.int64)})
    with pytest.raises(ValueError, match="must match"):
        paged_attention_decode(**{**ok, "q": q.half(), "out": q.half()})
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv(k=torch.zeros(3, 2, 16), v=torch.zeros(3, 2, 16), k_cache=k_cache, v_cache=v_cache, slot_mapping=torch.zeros(3, dtype=torch.int32))


@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_refuses_strided_index_tensors_and_odd_scales(backend, gen):
    # The Triton kernels step along these with stride 1: a strided view gave wrong rows (decode, write_kv)
    # or corrupted memory (prefill's query_start_loc) instead of an error.
    k_cache, v_cache = paged_caches(4, 4, 2, 16, torch.float32, gen)
    q = torch.randn(2, 4, 16)
    tables = torch.zeros(3, 2, dtype=torch.int32).t()  # [2, 3], stride (1, 2)
    lens = torch.ones(4, dtype=torch.int32)[::2]
    ok = dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=torch.zeros(2, 3, dtype=torch.int32), context_lens=torch.ones(2, dtype=torch.int32),
              scale=1.0, out=torch.empty_like(q), backend=backend)  # fmt: skip
    with pytest.raises(ValueError, match="block_tables must be int32 .* contiguous last dim"):
        paged_attention_decode(**{**ok, "block_tables": tables})
    with pytest.raises(ValueError, match="context_lens must be contiguous"):
        paged_attention_decode(**{**ok, "context_lens": lens})
    with pytest.raises(ValueError, match="scale must be a Python float"):
        paged_attention_decode(**{**ok, "scale": torch.tensor(1.0)})
    with pytest.raises(ValueError, match="floating dtype"):
        paged_attention_decode(**{**ok, "q": q.int(), "out": q.int(), "k_cache": k_cache.int(), "v_cache": v_cache.int()})
    qsl = torch.tensor([0, 9, 1, 9, 2, 9], dtype=torch.int32)[::2]
    with pytest.raises(ValueError, match="query_start_loc must be contiguous"):
        paged_attention_prefill(**{**ok, "query_start_loc": qsl})
    kv = torch.zeros(3, 2, 16)
    with pytest.raises(ValueError, match="slot_mapping must be contiguous"):
        write_kv(k=kv, v=kv, k_cache=k_cache, v_cache=v_cache, slot_mapping=torch.zeros(6, dtype=torch.int64)[::2], backend=backend)
    with pytest.raises(ValueError, match="k is on meta"):
        write_kv(k=kv.to("meta"), v=kv, k_cache=k_cache, v_cache=v_cache, slot_mapping=torch.zeros(3, dtype=torch.int64), backend=backend)


def _strided_head_dim(*shape: int) -> torch.Tensor:
    """A tensor of `shape` whose last dim has stride 2."""
    return torch.zeros(*shape, 2)[..., 0]


QUERY_REFUSALS = [
    ({"out": torch.empty(2, 4, 16, dtype=torch.float16)}, "out must be torch.float32 .2, 4, 16."),
    ({"out": torch.empty(2, 4, 8)}, "out must be"),
    ({"out": _strided_head_dim(2, 4, 16)}, "out must be .* contiguous head_dim"),
    ({"out": torch.empty(2, 4, 16, device="meta")}, "out is on meta, q on cpu"),
    ({"q": _strided_head_dim(2, 4, 16)}, "q's head_dim must be contiguous"),
    ({"q": torch.randn(2, 4, 8), "out": torch.empty(2, 4, 8)}, r"q must be \[\*, Hq, 16\]"),
    ({"q": torch.randn(2, 64), "out": torch.empty(2, 64)}, r"q must be \[\*, Hq, 16\]"),
    ({"v_cache": torch.zeros(5, 4, 2, 16)}, "k_cache and v_cache must both be"),
    ({"v_cache": torch.zeros(4, 4, 2, 16, dtype=torch.float16)}, "must share dtype and device"),
    ({"k_cache": _strided_head_dim(4, 4, 2, 16), "v_cache": _strided_head_dim(4, 4, 2, 16)}, "the caches' head_dim must be contiguous"),
    ({"k_cache": torch.zeros(4, 4, 32), "v_cache": torch.zeros(4, 4, 32)}, "k_cache and v_cache must both be"),
    ({"context_lens": torch.ones(2, dtype=torch.int64)}, "context_lens must be contiguous int32"),
    ({"context_lens": torch.tensor(1, dtype=torch.int32)}, "context_lens must be"),  # 0-d: was an IndexError in prefill
    ({"block_tables": torch.zeros(3, 3, dtype=torch.int32)}, r"block_tables must be int32 \[2, max_blocks\]"),
    ({"block_tables": torch.zeros(3, dtype=torch.int32)}, "block_tables must be int32"),
    ({"block_tables": torch.zeros(2, 3, dtype=torch.int32, device="meta")}, "block_tables is on meta, q on cpu"),
    ({"context_lens": torch.ones(2, dtype=torch.int32, device="meta")}, "context_lens is on meta, q on cpu"),
    ({"scale": None}, "scale must be a Python float"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["decode", "prefill"])
@pytest.mark.parametrize("change,message", QUERY_REFUSALS, ids=range(len(QUERY_REFUSALS)))
def test_decode_and_prefill_refuse(backend, kind, change, message, gen):
    k_cache, v_cache = paged_caches(4, 4, 2, 16, torch.float32, gen)
    q = torch.randn(2, 4, 16)
    args = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_tables": torch.zeros(2, 3, dtype=torch.int32),
            "context_lens": torch.ones(2, dtype=torch.int32), "scale": 1.0, "out": torch.empty_like(q), "backend": backend, **change}  # fmt: skip
    with pytest.raises(ValueError, match=message):
        if kind == "decode":
            paged_attention_decode(**args)
        else:
            paged_attention_prefill(**args, query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32))


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_refuses_bad_query_start_loc(backend, gen):
    k_cache, v_cache = paged_caches(4, 4, 2, 16, torch.float32, gen)
    q = torch.randn(2, 4, 16)
    args = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_tables": torch.zeros(2, 3, dtype=torch.int32),
            "context_lens": torch.ones(2, dtype=torch.int32), "scale": 1.0, "out": torch.empty_like(q), "backend": backend}  # fmt: skip
    for qsl in (torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0, 1, 2]), torch.tensor([0, 1, 2], dtype=torch.int32, device="meta")):
        with pytest.raises(ValueError, match=r"query_start_loc must be contiguous int32 \[3\] on cpu"):
            paged_attention_prefill(**args, query_start_loc=qsl)


WRITE_REFUSALS = [
    ({"v": torch.zeros(3, 2, 8)}, r"k and v must be \[T, 2, 16\]"),
    ({"k": torch.zeros(3, 32), "v": torch.zeros(3, 32)}, r"k and v must be \[T, 2, 16\]"),
    ({"k": torch.zeros(3, 4, 16), "v": torch.zeros(3, 4, 16)}, r"k and v must be \[T, 2, 16\]"),
    ({"k": torch.zeros(3, 2, 16, dtype=torch.float16), "v": torch.zeros(3, 2, 16, dtype=torch.float16)}, "the cache torch.float32; they must match"),
    ({"k": _strided_head_dim(3, 2, 16)}, "k and v need a contiguous head_dim"),
    ({"slot_mapping": torch.zeros(4, dtype=torch.int64)}, r"slot_mapping must be contiguous int64 \[3\]"),
    ({"v": torch.zeros(3, 2, 16, device="meta")}, "v is on meta, the caches on cpu"),
    ({"k_cache": _strided_head_dim(4, 4, 2, 16), "v_cache": _strided_head_dim(4, 4, 2, 16)}, "the caches' head_dim must be contiguous"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("change,message", WRITE_REFUSALS, ids=range(len(WRITE_REFUSALS)))
def test_write_kv_refuses(backend, change, message, gen):
    k_cache, v_cache = paged_caches(4, 4, 2, 16, torch.float32, gen)
    args = {"k": torch.zeros(3, 2, 16), "v": torch.zeros(3, 2, 16), "k_cache": k_cache, "v_cache": v_cache, "slot_mapping": torch.zeros(3, dtype=torch.int64),
            "backend": backend, **change}  # fmt: skip
    with pytest.raises(ValueError, match=message):
        write_kv(**args)


@pytest.mark.parametrize("head_dim", [4, 8, 16])
def test_any_real_scale_and_a_head_dim_below_the_dot_s_smallest_give_the_reference_s_answer(head_dim, gen):
    """A NumPy float32 or a Fraction is a real scale: taken as a Python float on every backend (Triton cannot
    take the others). A head_dim below 16 runs in a block of 16 with its lanes masked (a GPU's dot takes no
    narrower 16-bit operand)."""
    from fractions import Fraction

    import numpy as np

    k_cache, v_cache = paged_caches(4, 4, 2, head_dim, torch.float32, gen)
    q = torch.randn(2, 4, head_dim, generator=gen)
    case = dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
                context_lens=torch.tensor([5, 8], dtype=torch.int32))
    want = torch.empty_like(q)
    paged_attention_decode(**case, scale=0.3, out=want, backend="reference")
    for scale in (np.float32(0.3), Fraction(3, 10)):
        got = torch.full_like(q, float("nan"))
        paged_attention_decode(**case, scale=scale, out=got, backend="triton")
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
