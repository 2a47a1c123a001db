from torch import nn

from poplar.engine.units import build_units
from tests.helpers.models import TinyLM


def names(model, units):
    ids = {id(p): n for n, p in model.named_parameters()}
    return [(u.name, sorted(ids[id(p)] for p in u.params)) for u in units]


def test_module_list_entries_become_units_and_root_keeps_the_rest():
    model = TinyLM(layers=3)
    units = build_units(model)
    assert [u.name for u in units] == ["", "blocks.0", "blocks.1", "blocks.2"]
    root = dict(names(model, units))[""]
    assert root == ["embed.weight", "norm.bias", "norm.weight"]   # head.weight is tied to embed.weight
    assert sum(p.numel() for u in units for p in u.params) == sum(p.numel() for p in model.parameters())


def test_tied_parameter_spanning_units_goes_to_their_common_ancestor():
    model = nn.Sequential(nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)]))
    model[0][1].weight = model[0][0].weight
    units = build_units(model)
    where = {u.name: [id(p) for p in u.params] for u in units}
    assert id(model[0][0].weight) in where[""]
    assert id(model[0][0].weight) not in where["0.0"]


def test_unit_classes_and_size_threshold_and_frozen_parameters():
    model = TinyLM(layers=2)
    assert [u.name for u in build_units(model, unit_classes=["LayerNorm"])] == ["", "blocks.0.norm", "blocks.1.norm", "norm"]
    model.embed.weight.requires_grad_(False)
    units = build_units(model, unit_numel=10**9)
    assert all(id(model.embed.weight) not in {id(p) for p in u.params} for u in units)
    big = nn.Sequential(nn.Linear(100, 100), nn.Linear(2, 2))
    assert [u.name for u in build_units(big, unit_numel=5000)] == ["", "0"]
