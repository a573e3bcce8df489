"""The on-device tensor digest of --debug-determinism (miles/utils/digest.py): every single-bit change
shows, equal values give equal digests whatever the storage, and the integers are those of exact
arithmetic modulo 2^64 (checked against Python's integers) on every code path."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from miles.utils import digest
from miles.utils.digest import BLOCK, block_sums, multipliers, named_tensors_digest16

DTYPES = {"fp32": (torch.float32, torch.int32, 32), "bf16": (torch.bfloat16, torch.int16, 16),
          "int64": (torch.int64, torch.int64, 64)}


def one(t: torch.Tensor) -> str:
    return named_tensors_digest16([("w", t)])


def random_tensor(dtype, numel: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.int64:
        return torch.randint(-2**63, 2**63 - 1, (numel,), dtype=torch.int64, generator=g)
    return torch.randn(numel, generator=g).to(dtype)


def flip(t: torch.Tensor, index: int, bit: int) -> torch.Tensor:
    """A copy of t with one bit of one element flipped (bit 0 the lowest; the top bit is the sign)."""
    _, int_dtype, bits = next(v for v in DTYPES.values() if v[0] == t.dtype)
    out = t.clone()
    words = out.view(int_dtype)
    mask = torch.tensor(1 << bit if bit < bits - 1 else -(1 << bit), dtype=int_dtype)  # the sign bit as a negative
    words[index] ^= mask
    return out


@pytest.mark.parametrize("name", DTYPES)
@pytest.mark.parametrize("numel", [1, 7, BLOCK, BLOCK + 3, 2 * BLOCK + 1])
def test_every_bit_of_the_first_middle_and_last_element_shows(name, numel):
    dtype, _, bits = DTYPES[name]
    t = random_tensor(dtype, numel, seed=numel)
    base = one(t)
    for index in sorted({0, numel // 2, numel - 1}):
        for bit in range(bits):
            assert one(flip(t, index, bit)) != base, (name, numel, index, bit)


@settings(max_examples=150, deadline=None)
@given(name=st.sampled_from(list(DTYPES)), numel=st.integers(1, 3 * BLOCK), seed=st.integers(0, 2**31),
       where=st.floats(0, 1, exclude_max=True), bit=st.integers(0, 63))
def test_any_single_bit_flip_changes_the_digest(name, numel, seed, where, bit):
    dtype, _, bits = DTYPES[name]
    t = random_tensor(dtype, numel, seed)
    assert one(flip(t, int(where * numel), bit % bits)) != one(t)


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(list(DTYPES)), rows=st.integers(1, 40), cols=st.integers(1, 40), seed=st.integers(0, 99))
def test_equal_values_equal_digests_whatever_the_storage(name, rows, cols, seed):
    dtype = DTYPES[name][0]
    t = random_tensor(dtype, rows * cols, seed).view(rows, cols)
    assert one(t.clone()) == one(t)
    transposed = t.t().contiguous().t()  # the same values, column-major strides
    assert not transposed.is_contiguous() or rows == 1 or cols == 1
    assert one(transposed) == one(t)
    big = random_tensor(dtype, (rows + 2) * (cols + 3), seed + 1).view(rows + 2, cols + 3)
    big[1:rows + 1, 2:cols + 2] = t
    window = big[1:rows + 1, 2:cols + 2]  # a storage offset and a row stride of cols + 3
    assert window.storage_offset() > 0
    assert one(window) == one(t)


def test_name_dtype_shape_and_order_are_in_the_digest():
    t = torch.arange(12, dtype=torch.float32)
    assert named_tensors_digest16([("a", t)]) != named_tensors_digest16([("b", t)])
    assert one(t) != one(t.view(3, 4))
    assert one(t) != one(t.view(torch.int32))  # the same bytes as another dtype
    u = t + 100
    assert named_tensors_digest16([("a", t), ("b", u)]) != named_tensors_digest16([("a", u), ("b", t)])
    assert named_tensors_digest16([("a", None)]) != named_tensors_digest16([("a", torch.zeros(0))])
    assert one(torch.zeros(5)) != one(torch.zeros(6))  # zeros' sums are 0: the shape tells them apart
    assert len(one(t)) == 16 and int(one(t), 16) >= 0


def test_a_swap_of_two_elements_shows():
    t = torch.randn(3 * BLOCK)
    for i, j in [(0, 1), (0, BLOCK), (5, 2 * BLOCK + 5), (BLOCK - 1, BLOCK)]:
        u = t.clone()
        u[i], u[j] = t[j], t[i]
        assert one(u) != one(t), (i, j)


def reference_sums(words: list[int]) -> list[int]:
    """Block sums in Python's exact integers, reduced modulo 2^64 to int64."""
    m = [int(x) for x in multipliers()]
    out = []
    for a in range(0, len(words), BLOCK):
        s = sum(w * m[k] for k, w in enumerate(words[a:a + BLOCK])) % 2**64
        out.append(s - 2**64 if s >= 2**63 else s)
    return out


@pytest.mark.parametrize("name", DTYPES)
def test_block_sums_are_exact_arithmetic_modulo_2_64_on_both_paths(name):
    dtype, int_dtype, _ = DTYPES[name]
    t = random_tensor(dtype, 2 * BLOCK + 11, seed=3)
    if dtype == torch.int64:  # large words and multipliers: every product and sum overflows int64
        t[:4] = torch.tensor([2**63 - 1, -2**63, -1, 2**62])
    expected = reference_sums(t.view(int_dtype).tolist())
    assert block_sums(t).tolist() == expected  # the CPU (numpy) path
    assert digest._block_sums_torch(t.view(int_dtype)).tolist() == expected  # the torch-kernel path a GPU runs


def test_multipliers_are_odd_distinct_and_fixed():
    m = multipliers()
    assert len(m) == BLOCK and (m & 1).all() and len(set(m.tolist())) == BLOCK
    assert int(m[0]) == -2152535657050944081  # splitmix64(1) | 1: the digests of every release depend on it


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", DTYPES)
def test_cuda_digest_equals_the_cpu_digest(name):
    dtype = DTYPES[name][0]
    tensors = [("big", random_tensor(dtype, 3 * digest.CHUNK_BLOCKS["cuda"] * BLOCK + 5, 1)),
               ("small", random_tensor(dtype, 9, 2)), ("none", None)]
    on_gpu = [(n, t.cuda() if t is not None else None) for n, t in tensors]
    assert named_tensors_digest16(on_gpu) == named_tensors_digest16(tensors)
