"""What every integration's automatic planning says first (its lines as it profiles: the cluster-alone tests of
each integration, which start ranks)."""

import doctest

import pytest

import poplar.integrations.session
from poplar.cluster.spec import load_cluster
from poplar.integrations.session import profiling_title


@pytest.mark.parametrize("stages, words", [((0, 1, 2, 3), "ZeRO stages 0-3"), ((1,), "ZeRO stage 1"),
                                           ((2, 0), "ZeRO stages 0, 2")])
def test_the_first_line_names_the_model_the_cluster_its_kinds_the_stages_and_how_long(stages, words):
    line = profiling_title("both-differ", "LitTiny", load_cluster("both-differ"), stages)
    assert line.startswith("both-differ: profiling LitTiny on 1 x ")   # the cluster first: every line after says it
    assert f" in {words} (cached after the first run): each stage is shown as it ends" in line


def test_the_module_examples_run():
    failed, tried = doctest.testmod(poplar.integrations.session)
    assert tried > 0 and failed == 0
