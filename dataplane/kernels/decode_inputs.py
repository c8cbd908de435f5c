"""Fill a captured decode step's input buffers from the step's staged arrays, in one launch.

A decode step replays a CUDA graph that reads fixed buffers: token ids, positions, slot
mapping, sequence lengths and block tables, padded to the graph's size. Filled with torch ops
they cost a step about twelve small kernels outside the graph (casts, gathers, the block
mirror's update, copies, pads; ~30 us of device time at 256 rows on the H200, in
bench/results/h200/profile-256-76a6a4d.log). Here program i fills row i of the graph's size:

- i < num_reqs: the token id read from the token table at its index, the position, slot and
  sequence length copied from the staged arrays (int64), and the block-table row gathered
  from the device mirror of the request's slot, with the blocks this step appended to it
  (which it also writes into the mirror, for later steps);
- i >= num_reqs (padding): slot -1 (stores nothing), sequence length 0 (reads nothing).

A request's appended blocks are contiguous in the staged block ids (`new_start`, `new_count`)
and take the columns from `new_column` on: blocks are only ever appended to a request.
"""

import torch
import triton
import triton.language as tl

from dataplane.kernels.sizes import next_power_of_2


# The staged arrays are views into one copy at any int64 offset: their alignment must not pick
# a variant (one compiles at configure; a served step must not compile another).
_STAGED = ["positions_ptr", "token_index_ptr", "slot_mapping_ptr", "seq_lens_ptr", "slots_ptr",
           "new_start_ptr", "new_count_ptr", "new_column_ptr", "new_blocks_ptr"]


@triton.jit(do_not_specialize=["num_reqs", "stride_mirror", "stride_table"],
            do_not_specialize_on_alignment=_STAGED)
def _decode_inputs_kernel(
    positions_ptr, token_index_ptr, slot_mapping_ptr, seq_lens_ptr, slots_ptr,
    new_start_ptr, new_count_ptr, new_column_ptr, new_blocks_ptr,
    token_table_ptr, mirror_ptr,
    token_ids_ptr, out_positions_ptr, out_slot_mapping_ptr, out_seq_lens_ptr, block_tables_ptr,
    num_reqs, stride_mirror, stride_table,
    PAGE_SIZE: tl.constexpr, BLOCK_COLS: tl.constexpr,
):
    row = tl.program_id(0)
    if row < num_reqs:
        tl.store(token_ids_ptr + row, tl.load(token_table_ptr + tl.load(token_index_ptr + row)))
        tl.store(out_positions_ptr + row, tl.load(positions_ptr + row))
        tl.store(out_slot_mapping_ptr + row, tl.load(slot_mapping_ptr + row))
        seq_len = tl.load(seq_lens_ptr + row)
        tl.store(out_seq_lens_ptr + row, seq_len.to(tl.int32))
        mirror = mirror_ptr + tl.load(slots_ptr + row) * stride_mirror
        table = block_tables_ptr + row.to(tl.int64) * stride_table
        start = tl.load(new_start_ptr + row)
        count = tl.load(new_count_ptr + row)
        first_new = tl.load(new_column_ptr + row)
        num_cols = tl.maximum(tl.cdiv(seq_len, PAGE_SIZE), first_new + count)
        for lo in range(0, num_cols, BLOCK_COLS):
            cols = lo + tl.arange(0, BLOCK_COLS)
            in_row = cols < num_cols
            is_new = (cols >= first_new) & (cols < first_new + count)
            old = tl.load(mirror + cols, mask=in_row & ~is_new, other=0)
            new = tl.load(new_blocks_ptr + start + cols - first_new, mask=is_new, other=0)
            ids = tl.where(is_new, new.to(tl.int32), old)
            tl.store(table + cols, ids, mask=in_row)
            tl.store(mirror + cols, ids, mask=is_new)
    else:
        tl.store(out_slot_mapping_ptr + row, -1)
        tl.store(out_seq_lens_ptr + row, 0)


def _check_staged(*arrays: torch.Tensor) -> None:
    for a in arrays:
        assert a.dtype == torch.int64 and a.dim() == 1 and a.stride(0) == 1, (a.dtype, a.shape)


def decode_inputs(positions: torch.Tensor, token_index: torch.Tensor, slot_mapping: torch.Tensor,
                  seq_lens: torch.Tensor, slots: torch.Tensor, new_start: torch.Tensor,
                  new_count: torch.Tensor, new_column: torch.Tensor, new_blocks: torch.Tensor,
                  token_table: torch.Tensor, mirror: torch.Tensor, token_ids: torch.Tensor,
                  out_positions: torch.Tensor, out_slot_mapping: torch.Tensor,
                  out_seq_lens: torch.Tensor, block_tables: torch.Tensor, size: int,
                  page_size: int) -> None:
    """Staged, int64, one per request (num_reqs of them): positions, token_index (into the
    flattened token table), slot_mapping, seq_lens, slots; new_start, new_count, new_column: the
    request's appended blocks, from new_blocks[new_start] on, at columns new_column on (count 0:
    none). token_table: [max_num_seqs, max_model_len] int64; mirror: [max_num_seqs, max_blocks]
    int32, the device's block tables by slot (updated with the appended blocks). Outputs, the
    graph's buffers of at least `size` rows: token_ids, out_positions, out_slot_mapping int64,
    out_seq_lens int32, block_tables [rows, max_blocks] int32."""
    num_reqs = positions.shape[0]
    _check_staged(positions, token_index, slot_mapping, seq_lens, slots, new_start, new_count,
                  new_column, new_blocks, token_ids, out_positions, out_slot_mapping)
    assert all(a.shape == (num_reqs,) for a in (token_index, slot_mapping, seq_lens, slots,
                                                new_start, new_count, new_column))
    assert num_reqs <= size <= min(token_ids.shape[0], out_seq_lens.shape[0],
                                   block_tables.shape[0])
    assert token_table.dtype == torch.int64 and token_table.is_contiguous()
    assert mirror.dtype == block_tables.dtype == out_seq_lens.dtype == torch.int32
    assert mirror.stride(1) == 1 and block_tables.stride(1) == 1
    assert block_tables.shape[1] == mirror.shape[1]
    if size == 0:
        return
    _decode_inputs_kernel[(size,)](
        positions, token_index, slot_mapping, seq_lens, slots,
        new_start, new_count, new_column, new_blocks, token_table, mirror,
        token_ids, out_positions, out_slot_mapping, out_seq_lens, block_tables,
        num_reqs, mirror.stride(0), block_tables.stride(0),
        PAGE_SIZE=page_size, BLOCK_COLS=min(256, next_power_of_2(mirror.shape[1])),
        num_warps=1)


def decode_inputs_ref(positions: torch.Tensor, token_index: torch.Tensor,
                      slot_mapping: torch.Tensor, seq_lens: torch.Tensor, slots: torch.Tensor,
                      new_start: torch.Tensor, new_count: torch.Tensor, new_column: torch.Tensor,
                      new_blocks: torch.Tensor, token_table: torch.Tensor, mirror: torch.Tensor,
                      token_ids: torch.Tensor, out_positions: torch.Tensor,
                      out_slot_mapping: torch.Tensor, out_seq_lens: torch.Tensor,
                      block_tables: torch.Tensor, size: int, page_size: int) -> None:
    """The same with torch ops, one request at a time."""
    n = positions.shape[0]
    for i in range(n):
        slot, start, count, column = (int(x[i]) for x in (slots, new_start, new_count, new_column))
        mirror[slot, column:column + count] = new_blocks[start:start + count].int()
        num_cols = max(-(-int(seq_lens[i]) // page_size), column + count)
        block_tables[i, :num_cols] = mirror[slot, :num_cols]
    token_ids[:n] = token_table.view(-1)[token_index]
    out_positions[:n] = positions
    out_slot_mapping[:n] = slot_mapping
    out_slot_mapping[n:size] = -1
    out_seq_lens[:n] = seq_lens.int()
    out_seq_lens[n:size] = 0
