"""MergePlan algebra on plans whose right answer is known by construction."""

import pytest
import torch

from tomerge import MergePlan


def groups_plan():
    # 6 tokens, slots: {0, 1, 4} -> 0, {2} -> 1, {3, 5} -> 2
    assign = torch.tensor([[0, 0, 1, 2, 0, 2]])
    dst = torch.tensor([[0, 2, 3]])
    return MergePlan.hard(assign, dst)


def test_hard_merge_is_group_mean_and_unmerge_copies_back():
    plan = groups_plan()
    x = torch.tensor([1.0, 2.0, 3.0, 4.0, 6.0, 8.0]).view(1, 6, 1)
    y = plan.merge(x)
    assert y.flatten().tolist() == [3.0, 3.0, 6.0]
    assert plan.unmerge(y).flatten().tolist() == [3.0, 3.0, 3.0, 6.0, 3.0, 6.0]
    assert plan.num_removed == 3
    assert plan.sizes.tolist() == [[3.0, 1.0, 2.0]]


def test_dense_matrices_match_index_ops():
    plan = groups_plan()
    W, U = plan.dense()
    assert W.shape == (1, 3, 6) and U.shape == (1, 6, 3)
    assert torch.allclose(W.sum(-1), torch.ones(1, 3))
    x = torch.randn(1, 6, 4)
    assert torch.allclose(W @ x, plan.merge(x))
    assert torch.allclose(plan.with_backend("dense").merge(x), plan.merge(x))
    assert torch.allclose(plan.with_backend("dense").unmerge(W @ x), plan.unmerge(W @ x))


def test_identity_plan_returns_the_same_object():
    plan = MergePlan.identity(2, 5)
    x = torch.randn(2, 5, 3)
    assert plan.merge(x) is x and plan.unmerge(x) is x and plan.num_removed == 0


def test_tiled_soft_plan_with_padding_matches_its_dense_form():
    B, N = 2, 7
    tiles = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]])  # 7 marks a padding slot
    W = torch.rand(B, 2, 2, 4)
    W[:, 1, :, 3] = 0
    W = W / W.sum(-1, keepdim=True)
    U = torch.rand(B, 2, 4, 2)
    plan = MergePlan.soft(W, U, dst=torch.tensor([[0, 1, 4, 5]] * B), num_tokens=N, tile_tokens=tiles)
    Wd, Ud = plan.dense()
    x = torch.randn(B, N, 3)
    assert torch.allclose(plan.merge(x), Wd @ x, atol=1e-6)
    y = torch.randn(B, 4, 3)
    assert torch.allclose(plan.unmerge(y), Ud @ y, atol=1e-6)
    # A token's row of U lands at its own position: token 5 is tile 1, member 1.
    assert torch.allclose(Ud[:, 5], U[:, 1, 1].new_zeros(B, 4).index_copy(1, torch.tensor([2, 3]), U[:, 1, 1]))


def test_from_matching_orders_slots_destinations_first():
    plan = MergePlan.from_matching(dst=torch.tensor([[1, 3]]), unmerged=torch.tensor([[0]]),
                                   merged=torch.tensor([[2]]), merged_into=torch.tensor([[1]]), num_tokens=4)
    assert plan.slot_of_token.tolist() == [[2, 0, 1, 1]]
    assert plan.dst.tolist() == [[1, 3, 0]]


@pytest.mark.parametrize("shape", [(1, 5, 2), (1, 6)])
def test_wrong_shapes_raise(shape):
    with pytest.raises(ValueError, match="expects"):
        groups_plan().merge(torch.randn(*shape))


def test_batch_mismatch_raises_but_a_single_plan_broadcasts():
    two = MergePlan.hard(torch.tensor([[0, 0, 1], [0, 1, 1]]), torch.tensor([[0, 2], [0, 1]]))
    with pytest.raises(ValueError, match="B=2"):
        two.merge(torch.randn(3, 3, 2))
    x = torch.randn(3, 6, 2)
    merged = groups_plan().merge(x)
    assert torch.allclose(merged[2], groups_plan().merge(x[2:3])[0])


def test_bad_backend_and_mismatched_soft_shapes_raise():
    with pytest.raises(ValueError, match="backend"):
        groups_plan().with_backend("fast")
    with pytest.raises(ValueError, match="unmerge weights"):
        MergePlan.soft(torch.rand(1, 2, 4), torch.rand(1, 2, 4), torch.tensor([[0, 1]]), 4)


def test_to_casts_weights_but_not_indices():
    plan = MergePlan.soft(torch.rand(1, 2, 4), torch.rand(1, 4, 2), torch.tensor([[0, 1]]), 4).to(torch.float64)
    assert plan.merge_weights.dtype == torch.float64 and plan.dst.dtype == torch.long
