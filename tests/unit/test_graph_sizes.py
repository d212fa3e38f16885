"""Which batch sizes a CUDA worker captures as graphs, and which one a batch replays."""

from __future__ import annotations

import pytest

from dstack.runtime.graphs import graph_sizes, padded_size


def test_every_size_up_to_32_then_every_eighth_and_the_largest() -> None:
    assert graph_sizes(1) == [1]
    assert graph_sizes(8) == list(range(1, 9))
    assert graph_sizes(32) == list(range(1, 33))
    assert graph_sizes(50) == [*range(1, 33), 40, 48, 50]
    assert graph_sizes(64) == [*range(1, 33), 40, 48, 56, 64]


def test_a_batch_replays_the_smallest_size_that_holds_it() -> None:
    sizes = graph_sizes(50)
    assert padded_size(sizes, 1) == 1
    assert padded_size(sizes, 32) == 32
    assert padded_size(sizes, 33) == 40
    assert padded_size(sizes, 49) == 50
    assert padded_size(sizes, 50) == 50


@pytest.mark.parametrize("n", [0, 51])
def test_a_batch_outside_the_sizes_is_an_error_naming_them(n: int) -> None:
    with pytest.raises(ValueError, match=f"a batch of {n} does not fit the captured sizes 1..50"):
        padded_size(graph_sizes(50), n)


def test_a_model_without_batches_is_refused() -> None:
    with pytest.raises(ValueError, match="max_batch must be at least 1"):
        graph_sizes(0)
