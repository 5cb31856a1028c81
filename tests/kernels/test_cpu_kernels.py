"""The compiled CPU kernels: equal to the torch reference, checked inputs, fallback."""

from __future__ import annotations

import random
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mm_serve.kernels.cpu_extension as ext
from mm_serve.kernels.attention_metadata import AttentionMetadata
from mm_serve.kernels.backend_select import select_attention_backend
from mm_serve.kernels.cpu_paged_attention import CompiledCpuAttention
from mm_serve.kernels.paged_attention_ref import (
    TorchRefAttention,
    decode_attention_ref,
    write_kv_ref,
)


@pytest.fixture(scope="module")
def ops():  # type: ignore[no-untyped-def]
    compiled = ext.cpu_kernel_ops()
    assert compiled is not None, "the kernels must build where the tests run (g++ and ninja are installed)"
    return compiled


@pytest.fixture(scope="module")
def op(ops):  # type: ignore[no-untyped-def]
    return ops.paged_decode_attention


def _case(lens: list[int], page: int, hkv: int, group: int, dim: int, seed: int, num_pages: int = 0):  # type: ignore[no-untyped-def]
    """Random query, a strided layer view of a page-major cache, shuffled block tables."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    need = sum(-(-n // page) for n in lens)
    num_pages = max(num_pages, need + 3)
    data = torch.randn(num_pages, 3, 2, page, hkv, dim, generator=gen)  # [P, layers, K/V, S, Hkv, D]
    k_cache, v_cache = data[:, 1, 0], data[:, 1, 1]
    free = list(range(num_pages))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // page))] for n in lens]
    width = max(len(t) for t in tables) + 2  # padding entries past every row's pages
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    query = torch.randn(len(lens), hkv * group, dim, generator=gen)
    return query, k_cache, v_cache, block_tables, torch.tensor(lens)


@pytest.mark.parametrize("dim", [48, 32, 64, 128])  # the generic path and the three unrolled head sizes
@pytest.mark.parametrize("group", [1, 2, 4])
def test_equals_reference_over_head_sizes_and_gqa_groups(op, dim: int, group: int) -> None:  # type: ignore[no-untyped-def]
    lens = [1, 15, 16, 17, 33, 64, 200, 5, 90, 128] * 4  # 40 rows: whole sequences per work item
    query, k, v, tables, ctx = _case(lens, page=16, hkv=2, group=group, dim=dim, seed=dim + group)
    got = op(query, k, v, tables, ctx, dim**-0.5)
    want = decode_attention_ref(query, k, v, tables, ctx, dim**-0.5)
    assert got.shape == want.shape == query.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@settings(max_examples=40, deadline=None)
@given(
    lens=st.lists(st.integers(1, 70), min_size=1, max_size=12),
    page=st.sampled_from([1, 4, 16]),
    hkv=st.integers(1, 4),
    group=st.integers(1, 3),
    dim=st.sampled_from([8, 64]),
    seed=st.integers(0, 1000),
)
def test_equals_reference_on_random_batches(
    op, lens: list[int], page: int, hkv: int, group: int, dim: int, seed: int,  # type: ignore[no-untyped-def]
) -> None:
    """Small batches (one KV head per work item), any page size, ragged lengths."""
    query, k, v, tables, ctx = _case(lens, page, hkv, group, dim, seed)
    got = op(query, k, v, tables, ctx, 0.3)
    torch.testing.assert_close(got, decode_attention_ref(query, k, v, tables, ctx, 0.3), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sharpness", [30.0, 1e4])  # scores ~100 apart, and so far apart that exp underflows
def test_peaked_softmax_equals_reference(op, sharpness: float) -> None:  # type: ignore[no-untyped-def]
    """The vector exp (AVX-512 builds) near its clamp: weights of 0 and ~1e-38 stay exact enough. Scores
    ~100 apart carry float32 rounding of ~1e-5 in their weights, in torch's float32 reference as in the
    kernel (each is ~9e-6 from the float64 answer, 1.1e-5 from each other on a Zen 5), so both are held
    to the float64 answer: the kernel within twice the reference's own error."""
    lens = [1, 7, 16, 17, 100, 333]
    query, k, v, tables, ctx = _case(lens, page=16, hkv=2, group=2, dim=64, seed=7)
    query = query * sharpness
    got = op(query, k, v, tables, ctx, 0.125)
    exact = decode_attention_ref(query.double(), k.double(), v.double(), tables, ctx, 0.125)
    torch_error = (decode_attention_ref(query, k, v, tables, ctx, 0.125).double() - exact).abs().max().item()
    assert torch.isfinite(got).all()
    assert (got.double() - exact).abs().max().item() <= 2 * torch_error + 1e-6


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_key_poisons_its_sequence_as_in_the_reference(op, bad: float) -> None:  # type: ignore[no-untyped-def]
    """A NaN or inf score must not be clamped into a finite, plausible answer."""
    lens = [20, 9]
    query, k, v, tables, ctx = _case(lens, page=16, hkv=2, group=2, dim=64, seed=3)
    k[int(tables[0, 0]), 5] = bad  # a K row of sequence 0 only
    got = op(query, k, v, tables, ctx, 0.125)
    want = decode_attention_ref(query, k, v, tables, ctx, 0.125)
    assert not torch.isfinite(want[0]).any() and not torch.isfinite(got[0]).any()
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)  # the other sequence is untouched


@pytest.mark.parametrize("dim", [32, 64, 128])
@pytest.mark.parametrize("copies", [1, 6])  # 6 rows: all heads per item on 1 thread, one head per item on 2
def test_result_does_not_depend_on_thread_count(op, dim: int, copies: int) -> None:  # type: ignore[no-untyped-def]
    query, k, v, tables, ctx = _case([37, 3, 150, 64, 1, 99] * copies, page=16, hkv=4, group=2, dim=dim, seed=5)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = op(query, k, v, tables, ctx, 0.125)
        torch.set_num_threads(2)
        two = op(query, k, v, tables, ctx, 0.125)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)  # each (sequence, head) is computed by one thread, in one order
    # A batch of one is split per KV head instead of per sequence: same sums, same order.
    for row in (0, 2, 5):
        alone = op(query[row:row + 1], k, v, tables[row:row + 1], ctx[row:row + 1], 0.125)
        assert torch.equal(alone[0], two[row])


@pytest.mark.parametrize("dim", [32, 64, 128])
@pytest.mark.parametrize("lens", [[5, 16, 21], [5, 16, 21, 33, 70, 100, 47, 64] * 2])  # short; past the prefetch distance
def test_reads_only_the_pages_of_each_context(op, dim: int, lens: list[int]) -> None:  # type: ignore[no-untyped-def]
    """Poisoning every slot outside the contexts (other pages, the tail of the last page) changes nothing."""
    query, k, v, tables, ctx = _case(lens, page=8, hkv=2, group=2, dim=dim, seed=1)
    clean = op(query, k, v, tables, ctx, 0.125)
    used = torch.zeros(k.shape[0], k.shape[1], dtype=torch.bool)
    for row, n in enumerate(lens):
        for t in range(n):
            used[tables[row, t // 8], t % 8] = True
    k[~used] = float("nan")
    v[~used] = float("inf")
    assert torch.equal(op(query, k, v, tables, ctx, 0.125), clean)


@pytest.mark.parametrize("dim", [32, 64, 128])
@pytest.mark.parametrize("page", [3, 5, 12, 24, 32])  # pages that do not divide the 16-token blocks, or span two
@pytest.mark.parametrize("rows", [3, 12])  # one KV head per work item, then every head of a sequence per item
def test_blocks_across_page_sizes_and_group_remainders(op, dim: int, page: int, rows: int) -> None:  # type: ignore[no-untyped-def]
    """Groups of 3 and 6 take the register passes' remainders (4 + 2 at head sizes 32 and 64, 2 + 1 at 128)."""
    lens = [1, 16, 17, 47, 48, 100, 5, 33, 64, 129, 2, 31][:rows]
    for group in (3, 6):
        query, k, v, tables, ctx = _case(lens, page=page, hkv=2, group=group, dim=dim, seed=page + group)
        got = op(query, k, v, tables, ctx, dim**-0.5)
        torch.testing.assert_close(got, decode_attention_ref(query, k, v, tables, ctx, dim**-0.5), rtol=1e-5, atol=1e-5)


def test_a_block_of_minus_inf_scores_before_finite_ones_weighs_nothing(op) -> None:  # type: ignore[no-untyped-def]
    """The online softmax starts at a maximum of -inf: a first block scoring -inf must get weight 0,
    not NaN (-inf - -inf), and a later finite block must be exact, as in the reference."""
    lens = [40, 20, 70]
    query, k, v, tables, ctx = _case(lens, page=16, hkv=2, group=2, dim=64, seed=11)
    query[:, :2, 0] = query[:, :2, 0].abs() + 1.0  # KV head 0's query rows: a positive first element
    k[int(tables[0, 0]), :, 0, 0] = float("-inf")  # sequence 0: tokens 0-15 score -inf on KV head 0
    k[int(tables[2, 0]), :, 0, 0] = float("-inf")  # sequence 2: tokens 0-31 ...
    k[int(tables[2, 1]), :, 0, 0] = float("-inf")
    got = op(query, k, v, tables, ctx, 0.125)
    want = decode_attention_ref(query, k, v, tables, ctx, 0.125)
    assert torch.isfinite(want).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for page in tables[1, :2]:  # every score of sequence 1 (20 tokens) on KV head 0: nothing to weigh, 0 as in torch
        k[int(page), :, 0, 0] = float("-inf")
    got = op(query, k, v, tables, ctx, 0.125)
    want = decode_attention_ref(query, k, v, tables, ctx, 0.125)
    assert torch.equal(want[1, :2], torch.zeros_like(want[1, :2]))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_long_context_whose_maximum_grows_every_block_stays_exact(op) -> None:  # type: ignore[no-untyped-def]
    """4,096 tokens scoring higher and higher: the running sums are rescaled at every block."""
    lens = [4096, 4000]
    query, k, v, tables, ctx = _case(lens, page=16, hkv=2, group=2, dim=64, seed=12)
    ramp = torch.linspace(0.0, 3.0, 4096)  # K rows scaled up along the context
    for row, n in enumerate(lens):
        for t in range(n):
            k[int(tables[row, t // 16]), t % 16] *= 1.0 + ramp[t]
    got = op(query, k, v, tables, ctx, 0.125)
    torch.testing.assert_close(got, decode_attention_ref(query, k, v, tables, ctx, 0.125), rtol=1e-5, atol=1e-5)


def test_bad_inputs_raise_clear_errors(op) -> None:  # type: ignore[no-untyped-def]
    query, k, v, tables, ctx = _case([10, 20], page=16, hkv=2, group=2, dim=64, seed=2)
    with pytest.raises(RuntimeError, match="is not a page of the cache"):
        op(query, k, v, torch.full_like(tables, k.shape[0]), ctx, 0.1)
    with pytest.raises(RuntimeError, match=r"context_lens\[1\] = 0 is outside"):
        op(query, k, v, tables, torch.tensor([10, 0]), 0.1)
    with pytest.raises(RuntimeError, match="outside"):
        op(query, k, v, tables, torch.tensor([10, tables.shape[1] * 16 + 1]), 0.1)
    with pytest.raises(RuntimeError, match="float32 only"):
        op(query.double(), k.double(), v.double(), tables, ctx, 0.1)
    with pytest.raises(RuntimeError, match="block_tables must be int64"):
        op(query, k, v, tables.int(), ctx, 0.1)
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        op(query[:, :3].contiguous(), k, v, tables, ctx, 0.1)
    with pytest.raises(RuntimeError, match="contiguous"):
        op(query, k.transpose(1, 2), v.transpose(1, 2), tables, ctx, 0.1)


@pytest.mark.parametrize("dim", [64, 32])
def test_fused_rope_write_and_attention_equal_the_reference_steps(ops, dim: int) -> None:  # type: ignore[no-untyped-def]
    """RoPE + K/V write + attention in one op: the cache receives bit-identical K/V, the
    output equals the reference path's."""
    from mm_serve.models.rope import apply_rotary

    lens = [1, 16, 17, 40, 9, 128]
    hq, hkv = 4, 2
    query, k, v, tables, ctx = _case(lens, page=16, hkv=hkv, group=2, dim=dim, seed=dim)
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(len(lens), (hq + 2 * hkv) * dim, generator=gen)
    angles = (ctx - 1).float()[:, None] * torch.rand(dim // 2, generator=gen)[None, :]
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    k_ref, v_ref = k.clone(), v.clone()
    qk = apply_rotary(qkv[:, : (hq + hkv) * dim].view(len(lens), hq + hkv, dim), cos, sin)
    slots = torch.tensor([int(tables[i, (n - 1) // 16]) * 16 + (n - 1) % 16 for i, n in enumerate(lens)])
    write_kv_ref(qk[:, hq:], qkv[:, (hq + hkv) * dim:].view(len(lens), hkv, dim), k_ref, v_ref, slots)
    want = decode_attention_ref(qk[:, :hq].contiguous(), k_ref, v_ref, tables, ctx, 0.2)

    got = ops.rope_paged_decode_attention(qkv, cos, sin, hq, k, v, tables, ctx, 0.2)
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match=r"qkv must be a contiguous \[B, \(Hq \+ 2 Hkv\) \* D\]"):
        ops.rope_paged_decode_attention(qkv[:, 1:], cos, sin, hq, k, v, tables, ctx, 0.2)
    with pytest.raises(RuntimeError, match="cos and sin"):
        ops.rope_paged_decode_attention(qkv, cos[:, :2], sin, hq, k, v, tables, ctx, 0.2)


def test_backend_uses_the_kernel_for_float32_decode_only(op) -> None:  # type: ignore[no-untyped-def]
    backend = select_attention_backend(torch.device("cpu"))
    assert isinstance(backend, CompiledCpuAttention)
    assert type(select_attention_backend(torch.device("cpu"), compiled_cpu=False)) is TorchRefAttention
    query, k, v, tables, ctx = _case([3, 40], page=16, hkv=2, group=2, dim=64, seed=3)
    meta = AttentionMetadata(is_prefill=False, seq_lens=[1, 1], slot_mapping=torch.tensor([0, 1]),
                             block_tables=tables, context_lens=ctx)
    # bfloat16 takes the reference path (the kernel is float32 only): it must not raise.
    half = backend.decode(query.bfloat16(), k.bfloat16(), v.bfloat16(), meta, 0.125)
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(backend.decode(query, k, v, meta, 0.125),
                               decode_attention_ref(query, k, v, tables, ctx, 0.125), rtol=1e-5, atol=1e-5)


def test_a_failed_build_warns_once_and_falls_back(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    broken = tmp_path / "broken.cpp"
    broken.write_text("#error this kernel does not build\n")
    monkeypatch.setattr(ext, "SOURCES", [broken])
    monkeypatch.setattr(ext, "_loaded", {})
    monkeypatch.setattr(ext, "_registered", lambda: None)  # as in a process that has not loaded the library
    monkeypatch.setenv("MM_SERVE_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.warns(RuntimeWarning, match=r"(?s)compiled CPU kernels unavailable.*error: #error this kernel does not build"):
        assert ext.cpu_kernel_ops() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not retried, no second warning
        assert ext.cpu_kernel_ops() is None
        assert type(select_attention_backend(torch.device("cpu"))) is TorchRefAttention
    assert (tmp_path / "cache" / "kernels").is_dir()


def test_cache_root_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("MM_SERVE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert ext.cache_root() == tmp_path / "mm-serve"
    monkeypatch.setenv("MM_SERVE_CACHE_DIR", str(tmp_path / "mine"))
    assert ext.cache_root() == tmp_path / "mine"


@pytest.mark.parametrize("shape", [(1, 512), (32, 512), (3, 7, 100), (2000, 64)])
def test_rms_norm_equals_torch(ops, shape: tuple[int, ...]) -> None:  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(len(shape))
    x = torch.randn(*shape, generator=gen) * 3
    weight = torch.randn(shape[-1], generator=gen)
    got = ops.rms_norm(x, weight, 1e-6)
    want = weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))  # transformers' LlamaRMSNorm
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
    with pytest.raises(RuntimeError, match="weight must be a contiguous"):
        ops.rms_norm(x, weight[:-1], 1e-6)
    with pytest.raises(RuntimeError, match="float32 CPU tensors only"):
        ops.rms_norm(x.double(), weight.double(), 1e-6)


def test_loaded_model_uses_the_compiled_norm_only_for_inference(ops, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from mm_serve.models.builder import build_llama
    from mm_serve.models.llama import RMSNorm
    from mm_serve.models.loader import load_model

    model_dir = build_llama(tmp_path / "m", seed=0)
    model = load_model(model_dir)
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert norms and all(m.compiled_kernel is not None for m in norms)
    assert all(m.compiled_kernel is None for m in load_model(model_dir, compiled_cpu_kernels=False).modules()
               if isinstance(m, RMSNorm))
    x = torch.randn(4, norms[0].weight.shape[0])
    with torch.inference_mode():
        fast = norms[0](x)
    slow = norms[0](x)  # grad enabled: torch's op, differentiable
    assert slow.requires_grad and not fast.requires_grad
    torch.testing.assert_close(fast, slow.detach(), rtol=2e-6, atol=1e-6)


def test_a_finished_build_loads_without_a_compiler(ops, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Later processes load the marked library directly: no compiler, no lock, no rebuild."""
    import os
    import subprocess
    import sys

    assert ext.is_built() and ext.library_path().is_file()
    code = ("import mm_serve.kernels.cpu_extension as e, torch; ops = e.cpu_kernel_ops(); "
            "print(ops is not None and ops.rms_norm(torch.ones(1, 4), torch.ones(4), 0.0).sum().item())")
    env = dict(os.environ, CXX="no-such-compiler-here", PATH=os.path.dirname(sys.executable))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "4.0", done.stderr
    assert "building" not in done.stderr and "unavailable" not in done.stderr


def test_no_compiler_gives_one_clear_warning(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    env = dict(os.environ, CXX="no-such-compiler-here", MM_SERVE_CACHE_DIR=str(tmp_path))
    done = subprocess.run([sys.executable, "-m", "mm_serve.kernels.cpu_extension"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1
    assert "no C++ compiler: 'no-such-compiler-here' is not on PATH" in done.stderr
    assert done.stderr.count("compiled CPU kernels unavailable") == 1 and "building" not in done.stderr
