"""quant/low_rank.py's LowRank: up's diagonal blocks (a fused projection's LoRA made of separate projections' LoRAs
side by side) found once, and the part's product on them against the dense product."""
import torch

from bigdit.quant.low_rank import MAX_BLOCKS, LowRank


def part(up, mid=None, rank=None):
    rank = up.shape[1] if rank is None else rank
    return LowRank((None, None, None), torch.randn(rank, 64) * 0.125, mid, up, 0.7)


def side_by_side(n_out, rank, blocks):
    mask = torch.block_diag(*[torch.ones(n_out // blocks, rank // blocks)] * blocks)
    return torch.randn(n_out, rank) * mask


def test_diagonal_blocks_are_found_where_up_has_them_and_only_there():
    torch.manual_seed(0)
    assert part(torch.randn(96, 24)).blocks == 1
    assert part(side_by_side(96, 24, 3)).blocks == 3
    assert part(side_by_side(96, 24, 6)).blocks == 6  # the finest split found (6 blocks are 3 and 2 too)
    assert part(side_by_side(96, 24, 2)).blocks == 2
    one_off = side_by_side(96, 24, 3)
    one_off[40, 2] = 1e-3  # one value off the diagonal, not at a corner: dense
    assert part(one_off).blocks == 1
    assert MAX_BLOCKS < 9 and part(side_by_side(90, 27, 9)).blocks == 3  # 9 blocks: 3 of them each
    assert part(side_by_side(96, 24, 3), mid=torch.randn(24, 24)).blocks == 1  # a mid mixes the ranks
    found = part(side_by_side(96, 24, 3))
    found.up.fill_(1.0)  # found when made: not read again
    assert found.blocks == 3


def test_the_product_on_diagonal_blocks_is_the_dense_product_and_reads_only_them():
    torch.manual_seed(1)
    x = torch.randn(50, 64)
    up = side_by_side(96, 24, 3)
    p = part(up)
    want = torch.randn(50, 96)
    dense = want.addmm(p.hidden(x), up.t(), alpha=0.7)
    got = want.clone()
    p.add_to(x, got)
    assert p.blocks == 3 and torch.allclose(got, dense, rtol=0, atol=1e-5), (got - dense).abs().max()
    garbage = part(up + (up == 0) * 5.0)
    garbage.down, garbage.blocks = p.down, 3  # told the blocks: what lies off them is never read
    got = want.clone()
    garbage.add_to(x, got)
    assert torch.allclose(got, dense, rtol=0, atol=1e-5)
    unblocked = want.clone()
    LowRank((None, None, None), p.down, None, garbage.up, 0.7).add_to(x, unblocked)
    assert not torch.allclose(unblocked, dense, rtol=0, atol=1e-2)  # the garbage counts where read
