"""Engine conventions: padded selections, paged slots, LSE bases; and the README's Python example."""
import math
import pathlib
import re

import numpy as np
import pytest

import kvsift


def test_padded_round_trip(rng):
    capacity = 9
    counts = rng.integers(0, capacity + 1, (3, 2)).astype(np.int32)
    indices = rng.integers(0, 1000, (3, 2, capacity)).astype(np.int32)
    padded = kvsift.to_padded(indices, counts)
    assert padded.dtype == np.int32 and padded.shape == (3, 2, capacity)
    for b in range(3):
        for h in range(2):
            n = counts[b, h]
            assert padded[b, h, :n].tolist() == indices[b, h, :n].tolist()
            assert (padded[b, h, n:] == -1).all()
    wide = kvsift.to_padded(indices, counts, width=12)
    assert wide.shape == (3, 2, 12) and (wide[..., capacity:] == -1).all()
    back, back_counts = kvsift.from_padded(wide)
    np.testing.assert_array_equal(back_counts, counts)
    for b in range(3):
        for h in range(2):
            assert back[b, h, :counts[b, h]].tolist() == indices[b, h, :counts[b, h]].tolist()


def test_padded_refusals():
    with pytest.raises(kvsift.Error, match="counts must lie in"):
        kvsift.to_padded(np.zeros((1, 4), np.int32), np.array([5], np.int32))
    with pytest.raises(kvsift.Error, match="valid entry after a -1"):
        kvsift.from_padded(np.array([[3, -1, 4]], np.int32))


def test_positions_to_slots_follows_the_block_table(rng):
    page_size, blocks = 16, 5
    block_table = rng.permutation(40)[:2 * blocks].reshape(2, blocks).astype(np.int32)
    positions = np.array([[0, 15, 16, 79, -1], [33, 2, -1, -1, 64]], dtype=np.int32)
    slots = kvsift.positions_to_slots(positions, block_table, page_size)
    for b in range(2):
        for i, pos in enumerate(positions[b]):
            expected = -1 if pos < 0 else block_table[b, pos // page_size] * page_size + pos % page_size
            assert slots[b, i] == expected
    swapped = kvsift.positions_to_slots(positions, block_table, page_size, seq=np.array([1, 0]))
    assert swapped[0, 1] == block_table[1, 0] * page_size + 15
    with pytest.raises(kvsift.Error, match="needs block 5"):
        kvsift.positions_to_slots(np.array([[80]], np.int32), block_table, page_size)


def test_lse_base2_round_trip_and_flashinfer_merge(rng):
    """FlashInfer's merge_state works in base 2: merging through the conversion equals kvsift's merge."""
    lse_a, lse_b = rng.normal(3, 2, (4, 8)).astype(np.float32), rng.normal(3, 2, (4, 8)).astype(np.float32)
    o_a, o_b = rng.standard_normal((4, 8, 64)).astype(np.float32), rng.standard_normal((4, 8, 64)).astype(np.float32)
    np.testing.assert_allclose(kvsift.lse_from_base2(kvsift.lse_to_base2(lse_a)), lse_a, rtol=1e-6)
    np.testing.assert_allclose(kvsift.lse_to_base2(lse_a), lse_a / math.log(2), rtol=1e-6)
    s_a, s_b = kvsift.lse_to_base2(lse_a), kvsift.lse_to_base2(lse_b)  # FlashInfer's merge_state, in base 2
    top = np.maximum(s_a, s_b)
    w_a, w_b = np.exp2(s_a - top), np.exp2(s_b - top)
    o2 = (o_a * w_a[..., None] + o_b * w_b[..., None]) / (w_a + w_b)[..., None]
    s = top + np.log2(w_a + w_b)
    o, lse = kvsift.merge_states([(o_a, lse_a), (o_b, lse_b)], out_dtype="float32")
    np.testing.assert_allclose(o, o2, atol=1e-5)
    np.testing.assert_allclose(lse, kvsift.lse_from_base2(s), atol=1e-5)


def test_readme_python_example_runs():
    readme = (pathlib.Path(__file__).parents[2] / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    assert blocks, "README.md has no python example"
    exec(compile(blocks[0], "README.md", "exec"), {})
