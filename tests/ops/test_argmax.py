"""The compiled argmax over logits rows against torch.argmax: the first index of the largest value, the first NaN
where a row holds one, every tail length of the 16-wide vector loop."""
import pytest
import torch


def rows(kind: str, n: int, v: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(n, v, generator=gen)
    if kind == "ties":
        x = torch.randint(0, 3, (n, v), generator=gen).float()
    elif kind == "nan":
        x[:, v // 2] = float("nan")
        x[:, -1] = float("nan")
    elif kind == "inf":
        x[:, v // 3] = float("inf")
        x[:, -1] = float("inf")
    elif kind == "all -inf":
        x[:] = -float("inf")
    elif kind == "signed zeros":
        x = torch.randint(-3, 1, (n, v), generator=gen).float()
        x[:, 0] = -0.0
    return x


@pytest.mark.parametrize("kind", ["random", "ties", "nan", "inf", "all -inf", "signed zeros"])
def test_argmax_rows_equals_torch(kernels, kind):
    gen = torch.Generator().manual_seed(0)
    for n in (1, 3, 64):
        for v in (1, 5, 15, 16, 17, 33, 1000, 49152):
            x = rows(kind, n, v, gen)
            assert torch.equal(kernels.argmax_rows(x), x.argmax(dim=-1)), (kind, n, v)


def test_argmax_rows_takes_views_and_refuses_other_dtypes(kernels):
    x = torch.randn(8, 100)
    assert torch.equal(kernels.argmax_rows(x[:, 10:90]), x[:, 10:90].argmax(dim=-1))
    with pytest.raises(RuntimeError, match="float32"):
        kernels.argmax_rows(x.double())
