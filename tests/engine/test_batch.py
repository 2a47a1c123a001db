import pytest
import torch

from poplar.engine.batch import batch_size, split_batch


def test_split_tensor_tuple_and_dict_into_micro_batches():
    x = torch.arange(12).reshape(6, 2)
    parts = split_batch({"x": x, "y": (x[:, 0], "tag")}, 2)
    assert len(parts) == 3
    assert torch.equal(parts[1]["x"], x[2:4])
    assert torch.equal(parts[2]["y"][0], x[4:6, 0])
    assert parts[0]["y"][1] == "tag"
    assert [batch_size(p) for p in split_batch(x, 4)] == [4, 2]


def test_bad_batches_are_named():
    with pytest.raises(ValueError, match="disagree on the number of samples"):
        batch_size((torch.zeros(3, 2), torch.zeros(4)))
    with pytest.raises(ValueError, match="holds no tensor"):
        batch_size([1, 2, 3])
    with pytest.raises(ValueError, match="0-dimensional"):
        batch_size(torch.tensor(1.0))


def test_split_by_sizes_and_their_sum_is_checked():
    x = torch.arange(7).reshape(7, 1)
    parts = split_batch(x, [3, 2, 2])
    assert [p[:, 0].tolist() for p in parts] == [[0, 1, 2], [3, 4], [5, 6]]
    with pytest.raises(ValueError, match="add up to 6, but the batch has 7"):
        split_batch(x, [3, 3])
