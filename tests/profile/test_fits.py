"""Refused from arithmetic, before anything is measured: a model whose states the whole cluster cannot hold."""

import math

import pytest

from poplar.cluster.spec import parse_cluster
from poplar.profile.fits import check_states_fit
from poplar.stages import stage
from poplar.models.workload import Workload


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_cluster_is_refused_exactly_where_its_memory_is_below_one_copy_of_zero_3_s_states(precision):
    wl = Workload(model="llama-small", seq_len=16)
    need = stage(3).sharded_bytes_per_param(precision) * wl.n_params()
    for count, scale_over_need, refused in ((1, 0.99, True), (1, 1.01, False), (3, 0.99, True), (3, 1.01, False)):
        gib = need * scale_over_need / count / 2**30      # each device's share of the memory the states need
        spec = parse_cluster({"devices": [{"kind": "x", "gpu": "A100-80GB", "count": count}],
                              "memory_scale": gib / 80})
        if refused:
            with pytest.raises(ValueError, match=f"more than the {count} device"):
                check_states_fit(wl, spec, precision)
        else:
            check_states_fit(wl, spec, precision)


@pytest.mark.parametrize("model", ["llama-small", "llama-1b", "bert-large"])
def test_a_preset_s_parameters_counted_from_two_of_its_layers_are_all_of_them(model):
    wl = Workload(model=model)
    assert wl.n_params() == sum(math.prod(shape) for shape in wl.param_shapes())
