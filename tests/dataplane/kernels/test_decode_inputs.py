import pytest
import torch

pytest.importorskip("triton")

from dataplane.kernels.decode_inputs import decode_inputs, decode_inputs_ref  # noqa: E402
from tests.dataplane.kernels.helpers import KERNEL_MARKS  # noqa: E402

pytestmark = KERNEL_MARKS

MAX_NUM_SEQS, MAX_LEN, PAGE = 8, 64, 4
MAX_BLOCKS = MAX_LEN // PAGE


def _step(gen: torch.Generator, seq_lens: list[int], new_counts: list[int],
          device: torch.device) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Staged arrays for decode requests in shuffled slots, with new blocks appended at the end
    of their rows (what InputBatch.stage sends), and the token table and block mirror."""
    n = len(seq_lens)
    slots = torch.randperm(MAX_NUM_SEQS, generator=gen)[:n]
    lens = torch.tensor(seq_lens, dtype=torch.int64)
    counts = torch.tensor(new_counts, dtype=torch.int64)
    positions = lens - 1
    first_column = -(-lens // PAGE) - counts  # the new blocks are the row's last ones
    starts = torch.cumsum(counts, 0) - counts
    new_blocks = torch.randint(0, 1000, (int(counts.sum()),), generator=gen)
    slot_mapping = torch.randint(0, 4000, (n,), generator=gen)
    staged = [positions, slots * MAX_LEN + positions, slot_mapping, lens, slots, starts,
              counts, first_column, new_blocks]
    token_table = torch.randint(0, 50000, (MAX_NUM_SEQS, MAX_LEN), generator=gen)
    mirror = torch.randint(0, 1000, (MAX_NUM_SEQS, MAX_BLOCKS), generator=gen).int()
    return ([a.to(device) for a in staged], token_table.to(device), mirror.to(device))


def _outputs(device: torch.device) -> list[torch.Tensor]:
    """Graph buffers poisoned with values no fill writes."""
    i64 = dict(dtype=torch.int64, device=device)
    return [torch.full((MAX_NUM_SEQS,), -7, **i64), torch.full((MAX_NUM_SEQS,), -7, **i64),
            torch.full((MAX_NUM_SEQS,), -7, **i64),
            torch.full((MAX_NUM_SEQS,), -7, dtype=torch.int32, device=device),
            torch.full((MAX_NUM_SEQS, MAX_BLOCKS), -7, dtype=torch.int32, device=device)]


@pytest.mark.parametrize("seq_lens,new_counts,size", [
    ([5], [1], 1),  # one request, its block appended this step
    ([1, 9, 64, 16, 33], [1, 0, 0, 0, 1], 8),  # padding rows after them
    ([8, 4, 17], [2, 0, 3], 4),  # more than one new block (a recompute's first decode)
    ([], [], 2),  # padding only: what configure compiles it with
])
def test_fill_matches_reference_exactly(seq_lens, new_counts, size, device, gen):
    """The same buffers and block mirror as the torch ops, bit for bit; rows past a request's
    blocks and past num_reqs keep what they held, but for the padding rows' slot and length."""
    staged, table, mirror = _step(gen, seq_lens, new_counts, device)
    expected_mirror = mirror.clone()
    got, expected = _outputs(device), _outputs(device)
    decode_inputs(*staged, table, mirror, *got, size=size, page_size=PAGE)
    decode_inputs_ref(*staged, table, expected_mirror, *expected, size=size, page_size=PAGE)
    assert torch.equal(mirror, expected_mirror)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    n = len(seq_lens)
    assert (got[2][n:size] == -1).all() and (got[3][n:size] == 0).all()
    assert (got[2][size:] == -7).all() and (got[3][size:] == -7).all()
