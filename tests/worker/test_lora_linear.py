"""lora_linear (base projection + LoRA delta) equals the dense answer: the delta after the GEMM (small
batches on CPU), written before it with the GEMM adding itself (prefill-sized batches), and beside it
on a side stream (CUDA, decode-sized batches)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lorafleet.kernels.lora import lora_silu_mul
from lorafleet.kernels.lora_layout import LoRABatch, make_lora_batch, pack_lora_layout
from lorafleet.worker.lora_linear import OVERLAP_TOKENS, gate_up_act, lora_linear
from tests.kernels.kernel_cases import dense_delta, random_adapters, token_slots

DIMS = {0: (64, 48), 1: (64, 16), 2: (64, 16)}  # a small fused q|k|v
OFFSETS = [0, 48, 64]


def _case(num_tokens: int, popularity: str, device: str, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    modules = random_adapters(num_slots=5, num_layers=2, dims=DIMS, gen=gen, ranks=(2, 8, 16))
    layout = pack_lora_layout(modules, num_layers=2, max_slots=5, page_elems=256, dtype=dtype, device=device)
    slots = token_slots(popularity, num_tokens, 5, gen)
    x = torch.randn(num_tokens, 64, generator=gen)
    w = torch.randn(80, 64, generator=gen) / 8
    want = x.double() @ w.double().T
    for proj, start in zip(range(3), OFFSETS, strict=True):
        width = DIMS[proj][1]
        want[:, start : start + width] += dense_delta(modules, slots, x, 1, proj, width)
    batch = make_lora_batch(slots.to(device), layout.max_rank_by_slot(), max_segment_len=16)
    return layout, batch, x.to(device, dtype), w.to(device, dtype), want


@pytest.mark.parametrize("popularity", ["uniform", "identical", "mixed_none", "all_none"])
@pytest.mark.parametrize("num_tokens", [37, OVERLAP_TOKENS + 37])  # delta after the GEMM / written before it
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_lora_linear_on_cpu_matches_dense(popularity, num_tokens, backend):
    layout, batch, x, w, want = _case(num_tokens, popularity, "cpu", torch.float32)
    ctx = SimpleNamespace(lora=batch, lora_layout=layout, backend=backend, lora_stream=None)
    y = lora_linear(x, w, ctx, 1, [0, 1, 2], OFFSETS)
    torch.testing.assert_close(y.double(), want, rtol=1e-4, atol=1e-4)


# The write-mode paths: prefill-sized batches (delta written, then the GEMM adds itself) on CPU and
# GPU, and decode-sized ones on a CUDA side stream (delta written into a buffer, then one add).
WRITE_PATHS = [
    pytest.param("cpu", OVERLAP_TOKENS + 37, id="cpu-prefill"),
    pytest.param("cuda", OVERLAP_TOKENS + 37, id="cuda-prefill", marks=pytest.mark.gpu),
    pytest.param("cuda", 37, id="cuda-side-stream", marks=pytest.mark.gpu),
]


def _ctx(batch, layout, device: str) -> SimpleNamespace:
    cuda = device == "cuda"
    return SimpleNamespace(lora=batch, lora_layout=layout, backend="triton" if cuda else "reference", lora_stream=torch.cuda.Stream() if cuda else None)


@pytest.mark.parametrize("device, num_tokens", WRITE_PATHS)
def test_write_paths_with_a_padded_batch_start_uncovered_rows_from_zero(device, num_tokens):
    """A batch built like the CUDA-graph decode's (token ids padded to the row count, rows without an
    adapter in no segment): rows the expand does not write must still get exactly x W^T."""
    from lorafleet.kernels.lora_layout import LoRABatch
    from lorafleet.worker.cuda_graphs import padded_groups

    layout, full, x, w, want = _case(num_tokens, "mixed_none", device, torch.float32)
    ids, starts, seg_slots = padded_groups(full.token_slots.tolist(), 16, num_tokens)
    assert len(ids) == num_tokens and (full.token_slots < 0).any()
    i32 = {"dtype": torch.int32, "device": device}
    batch = LoRABatch(full.token_slots, torch.tensor(ids, **i32), torch.tensor(starts, **i32), torch.tensor(seg_slots, **i32), full.max_rank)
    assert not batch.every_token
    y = lora_linear(x, w, _ctx(batch, layout, device), 1, [0, 1, 2], OFFSETS)
    torch.testing.assert_close(y.double().cpu(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device, num_tokens", WRITE_PATHS)
def test_write_paths_leave_columns_outside_the_slices_to_the_gemm(device, num_tokens):
    """Only k|v adapted (slices from column 48, or P+1 boundaries ending before N): the q columns must
    get exactly x W^T."""
    layout, full, x, w, want = _case(num_tokens, "identical", device, torch.float32)
    assert full.every_token
    base = x.double().cpu() @ w.double().cpu().T
    ctx = _ctx(full, layout, device)
    y = lora_linear(x, w, ctx, 1, [1, 2], [48, 64]).double().cpu()
    torch.testing.assert_close(y[:, :48], base[:, :48], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(y[:, 48:], want[:, 48:], rtol=1e-4, atol=1e-4)
    y = lora_linear(x, w, ctx, 1, [0], [0, 48]).double().cpu()  # q only, as P+1 boundaries: k|v columns are the GEMM's alone
    torch.testing.assert_close(y[:, 48:], base[:, 48:], rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 64, OVERLAP_TOKENS + 37])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_lora_linear_beside_the_gemm_matches_dense(num_tokens, dtype, tol):
    for popularity in ("uniform", "mixed_none", "all_none"):
        layout, batch, x, w, want = _case(num_tokens, popularity, "cuda", dtype)
        side = torch.cuda.Stream()
        for stream in (None, side):
            ctx = SimpleNamespace(lora=batch, lora_layout=layout, backend="triton", lora_stream=stream)
            y = lora_linear(x, w, ctx, 1, [0, 1, 2], OFFSETS)
            err = (y.double().cpu() - want).abs().max() / want.abs().max()
            assert not torch.isnan(y).any() and err < tol, (popularity, stream, float(err))


@pytest.mark.parametrize("popularity", ["uniform", "identical", "mixed_none", "all_none"])
@pytest.mark.parametrize("device, backend, num_tokens", [
    ("cpu", "reference", 37), ("cpu", "reference", OVERLAP_TOKENS + 37), ("cpu", "triton", OVERLAP_TOKENS + 37),
    pytest.param("cuda", "triton", OVERLAP_TOKENS + 37, marks=pytest.mark.gpu), pytest.param("cuda", "triton", 37, marks=pytest.mark.gpu),
])  # fmt: skip
def test_gate_up_act_matches_dense(popularity, device, backend, num_tokens, monkeypatch):
    """silu(gate) * up with the gate|up delta: folded into the activation for prefill-sized batches
    (tokens without an adapter take the plain activation), after lora_linear for small ones."""
    from lorafleet.kernels import lora
    from lorafleet.worker import lora_linear as module

    folded = []
    monkeypatch.setattr(lora, "lora_silu_mul", lambda **kw: folded.append(1) or lora_silu_mul(**kw))
    monkeypatch.setattr(module, "FUSED_ACT_MIN_SEGMENT_TOKENS", 16)  # small test batches: fold from 16 tokens per segment
    gen = torch.Generator().manual_seed(1)
    inter = 48
    modules = random_adapters(num_slots=5, num_layers=2, dims={4: (64, inter), 5: (64, inter)}, gen=gen, ranks=(2, 8, 16))
    layout = pack_lora_layout(modules, num_layers=2, max_slots=5, page_elems=256, dtype=torch.float32, device=device)
    slots = token_slots(popularity, num_tokens, 5, gen)
    x = torch.randn(num_tokens, 64, generator=gen)
    w = torch.randn(2 * inter, 64, generator=gen) / 8
    gu = x.double() @ w.double().T
    gate, up = gu[:, :inter] + dense_delta(modules, slots, x, 1, 4, inter), gu[:, inter:] + dense_delta(modules, slots, x, 1, 5, inter)
    for segment_len in (64, 4):  # about 20 tokens per segment (folded above OVERLAP_TOKENS tokens); 4 (never folded)
        folded.clear()
        batch = make_lora_batch(slots.to(device), layout.max_rank_by_slot(), max_segment_len=segment_len)
        ctx = SimpleNamespace(lora=batch, lora_layout=layout, backend=backend, lora_stream=torch.cuda.Stream() if device == "cuda" else None)
        act = gate_up_act(x.to(device), w.to(device), ctx, 1)
        torch.testing.assert_close(act.double().cpu(), torch.nn.functional.silu(gate) * up, rtol=1e-4, atol=1e-4)
        assert bool(folded) == (num_tokens > OVERLAP_TOKENS and popularity != "all_none" and segment_len == 64), (segment_len, batch.num_segments)


def test_fold_needs_a_prefill_of_long_segments():
    """The folded activation runs where it was measured to pay: above OVERLAP_TOKENS tokens, ranks up to
    FUSED_ACT_MAX_RANK, and segments of FUSED_ACT_MIN_SEGMENT_TOKENS tokens or more on average."""
    from lorafleet.worker.lora_linear import FUSED_ACT_MAX_RANK, FUSED_ACT_MIN_SEGMENT_TOKENS, folds_act

    assert FUSED_ACT_MIN_SEGMENT_TOKENS > 32  # H200: 32-token segments gain nothing from folding, 16-token ones lose
    ranks = torch.full((40,), 16, dtype=torch.int32)

    def batch(num_tokens, num_adapters, rank=16, base_tokens=0):
        slots = torch.cat([torch.arange(num_tokens) % num_adapters, torch.full((base_tokens,), -1)]).to(torch.int32)
        return make_lora_batch(slots, torch.full((40,), rank, dtype=torch.int32))

    assert folds_act(batch(1024, 8), 1024)  # 64-token segments (the engine's cut at this size)
    assert folds_act(batch(1024, 8, base_tokens=100), 1124)  # tokens without an adapter do not count
    assert folds_act(batch(2048, 16), 2048)
    assert not folds_act(batch(1024, 32), 1024)  # 32 tokens per adapter
    assert not folds_act(batch(256, 8), 256)  # 16-token segments
    one_segment = make_lora_batch(torch.zeros(64, dtype=torch.int32), ranks, max_segment_len=64)
    assert not folds_act(one_segment, 64)  # one 64-token segment, but a decode-sized step: the side stream's
    # The boundary: 96 tokens as 64 + 32 average 48 per segment; 94 as 64 + 30 do not.
    assert folds_act(make_lora_batch(torch.zeros(96, dtype=torch.int32), ranks, max_segment_len=64), 96)
    assert not folds_act(make_lora_batch(torch.zeros(94, dtype=torch.int32), ranks, max_segment_len=64), 94)
    assert not folds_act(batch(1024, 8, rank=2 * FUSED_ACT_MAX_RANK), 1024)
    assert not folds_act(None, 1024)
    assert not folds_act(make_lora_batch(torch.full((1024,), -1, dtype=torch.int32), ranks), 1024)  # no adapter at all


def test_a_step_computes_no_delta_for_the_layers_and_projections_no_adapter_of_its_batch_adapts(tiny_llama_dir,
                                                                                               monkeypatch):
    """On CPU the runner tells the layers which of their projections some adapter of the batch adapts: an
    adapter of q_proj in layer 1 only costs one q|k|v delta a step, not seven projections' in every layer (the
    demo's `shout`, 12 of 30 layers, decoded 2.5x slower than the base model). The tokens are the same."""
    from dataclasses import replace

    from lorafleet.kernels import lora
    from lorafleet.worker import Engine, EngineConfig, SamplingParams
    from tests.lora_factory import random_weights

    weights = random_weights(3, rank=4, projs=("q_proj",))
    weights = replace(weights, modules={k: m for k, m in weights.modules.items() if k[0] == 1})
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), device="cpu", dtype="float32", num_pages=64, block_size=4))
    try:
        engine.adapter_pool.add("q1@1", weights)
        calls, real = [], lora.lora_delta
        monkeypatch.setattr(lora, "lora_delta", lambda **kw: calls.append((kw["layer"], tuple(kw["proj_ids"]))) or real(**kw))
        params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
        outs = engine.generate([[1, 2, 3], [1, 2, 3]], params, adapters=["q1", None])
        assert calls and set(calls) == {(1, (0, 1, 2))}, set(calls)
        calls.clear()  # every projection of every layer computed (the adapter's rows zero elsewhere): the same tokens
        monkeypatch.setattr(LoRABatch, "adapts", lambda self, layer, proj_ids: True)
        every = engine.generate([[1, 2, 3], [1, 2, 3]], params, adapters=["q1", None])
        assert len(set(calls)) == 2 * 4 and [o.token_ids for o in outs] == [o.token_ids for o in every]
    finally:
        engine.close()
