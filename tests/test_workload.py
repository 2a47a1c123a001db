"""Workloads: the real-size presets, known by their shapes alone and refused where they cannot be built."""

import pytest

from poplar.workload import Workload


@pytest.mark.parametrize("model, billions, vocab", [("llama-1b", 1.50, 128256), ("llama-7b", 6.74, 32000),
                                                     ("llama-13b", 13.02, 32000), ("llama-70b", 68.98, 32000),
                                                     ("bert-large", 0.34, 30522)])
def test_real_size_presets_have_their_models_parameters(model, billions, vocab):
    wl = Workload(model=model)
    assert wl.vocab_size == vocab and wl.n_params() / 1e9 == pytest.approx(billions, abs=0.01)


def test_a_model_too_large_for_this_host_is_refused_before_it_is_built():
    with pytest.raises(ValueError, match=r"llama-70b has 69\.0B parameters .* plan it with `poplar simulate`"):
        Workload(model="llama-70b").build()
    assert Workload(model="llama-tiny", vocab_size=300).build() is not None
