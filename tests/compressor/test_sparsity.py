import pytest
import torch

from lmcompress.compressor.config import Sparsity, parse_sparsity
from lmcompress.compressor.sparsity import mask_from_scores, nm_mask, unstructured_mask
from lmcompress.errors import ConfigError


@pytest.mark.parametrize(("n", "m"), [(2, 4), (1, 4), (4, 8), (3, 8), (1, 2), (5, 16)])
def test_nm_mask_keeps_exactly_n_largest_per_group(n, m):
    torch.manual_seed(0)
    scores = torch.rand(24, m * 7)
    keep = nm_mask(scores, n, m)
    groups = keep.reshape(-1, m)
    assert torch.all(groups.sum(1) == n)
    # every kept score is >= every dropped score in its group
    s = scores.reshape(-1, m)
    kept_min = torch.where(groups, s, torch.inf).min(1).values
    dropped_max = torch.where(groups, -torch.inf, s).max(1).values
    assert torch.all(kept_min >= dropped_max)


def test_nm_groups_run_along_the_input_dimension():
    scores = torch.tensor([[4.0, 3.0, 2.0, 1.0, 1.0, 2.0, 3.0, 4.0]])
    keep = nm_mask(scores, 2, 4)
    assert keep.tolist() == [[True, True, False, False, False, False, True, True]]


def test_nm_mask_refuses_indivisible_width():
    with pytest.raises(ConfigError, match="not divisible by M=4"):
        nm_mask(torch.rand(3, 10), 2, 4)


@pytest.mark.parametrize("ratio", [0.1, 0.5, 0.9])
@pytest.mark.parametrize("per_row", [False, True])
def test_unstructured_mask_removes_the_ratio(ratio, per_row):
    """Against a plain Python reference: sort the scores of each row (``per_row``) or of the
    whole layer and drop the ``int(count · ratio)`` lowest. Distinct random scores: the answer
    is unique, so the masks must be equal."""
    scores = torch.rand(16, 40, generator=torch.Generator().manual_seed(0))
    keep = unstructured_mask(scores, ratio, per_row=per_row)
    groups = scores if per_row else scores.reshape(1, -1)  # (groups, size)
    expected = []
    for values in groups.tolist():
        lowest = sorted(range(len(values)), key=values.__getitem__)[: int(len(values) * ratio)]
        expected.append([i not in lowest for i in range(len(values))])
    assert keep.reshape(groups.shape).tolist() == expected
    for kept, values in zip(keep.reshape(groups.shape), groups, strict=True):
        assert values[~kept].max() < values[kept].min()  # in every row when per_row


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2:4", Sparsity(n=2, m=4)),
        (" 4 : 8 ", Sparsity(n=4, m=8)),
        ("0.5", Sparsity(ratio=0.5)),
        ("30%", Sparsity(ratio=0.3)),
        (0.25, Sparsity(ratio=0.25)),
    ],
)
def test_parse_sparsity(text, expected):
    parsed = parse_sparsity(text)
    assert parsed == expected
    assert mask_from_scores(torch.rand(4, 16), parsed).shape == (4, 16)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("4:4", "0 < N < M"),
        ("0:4", "0 < N < M"),
        ("5:4", "0 < N < M"),
        ("1.5", "between 0 and 1"),
        ("0", "between 0 and 1"),
        ("half", "neither N:M"),
        ("2:", "neither N:M"),
    ],
)
def test_parse_sparsity_rejects(text, message):
    with pytest.raises(ConfigError, match=message):
        parse_sparsity(text)
