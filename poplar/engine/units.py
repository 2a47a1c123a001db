"""Which parameters travel together: the model cut into units.

A unit is the granularity of everything the engine does: one flat buffer, one shard
per rank, one reduce(-scatter) bucket, and in ZeRO-3 one all-gather just before the
unit's module runs. By default every entry of an ``nn.ModuleList`` (a transformer's
blocks) is a unit, plus any other module whose own parameters reach ``unit_numel``;
the root unit keeps whatever is left (embeddings, final norm, head).

A parameter shared by several modules (tied embeddings) belongs to the smallest unit
that contains every module using it, so it is gathered whenever any of them runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from poplar.models.weights import names_of


@dataclass
class UnitSpec:
    module: nn.Module
    name: str                                   # the module's qualified name ("" for the root)
    params: list[nn.Parameter] = field(default_factory=list)


def _matches(module: nn.Module, unit_classes) -> bool:
    for c in unit_classes:
        if (isinstance(c, str) and type(module).__name__ == c) or (isinstance(c, type) and isinstance(module, c)):
            return True
    return False


def _trainable_numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def choose_unit_modules(model: nn.Module, unit_classes=None, unit_numel: int = 1_000_000) -> list[tuple[str, nn.Module]]:
    """Modules that become units, in pre-order (the root first)."""
    chosen: list[tuple[str, nn.Module]] = [("", model)]
    in_module_list: set[int] = set()
    for m in model.modules():
        if isinstance(m, nn.ModuleList):
            in_module_list.update(id(c) for c in m.children())

    def visit(prefix: str, module: nn.Module) -> int:
        """Returns the trainable numel of ``module``'s subtree not yet in a unit."""
        left = sum(p.numel() for p in module.parameters(recurse=False) if p.requires_grad)
        for name, child in module.named_children():
            child_name = f"{prefix}.{name}" if prefix else name
            pos = len(chosen)
            child_left = visit(child_name, child)
            if unit_classes:
                wanted = _matches(child, unit_classes)
            else:
                wanted = (id(child) in in_module_list and _trainable_numel(child) > 0) or child_left >= unit_numel
            if wanted and child_left > 0:
                chosen.insert(pos, (child_name, child))   # pre-order: before its own sub-units
                child_left = 0
            left += child_left
        return left

    visit("", model)
    return chosen


def build_units(model: nn.Module, unit_classes=None, unit_numel: int = 1_000_000) -> list[UnitSpec]:
    """Cut ``model``'s trainable parameters into units (pre-order; the root is unit 0)."""
    modules = choose_unit_modules(model, unit_classes, unit_numel)
    specs = [UnitSpec(m, name) for name, m in modules]
    params = {id(p): p for p in model.parameters() if p.requires_grad}
    registrations = {k: v for k, v in names_of(model).items() if k in params}

    def inside(unit_name: str, param_name: str) -> bool:
        return unit_name == "" or param_name.startswith(unit_name + ".")

    # Deepest unit first: a parameter goes to the innermost unit holding all its uses.
    by_depth = sorted(range(len(specs)), key=lambda i: -specs[i].name.count(".") - (specs[i].name != ""))
    owner: dict[int, int] = {}
    for pid, names in registrations.items():
        for i in by_depth:
            if all(inside(specs[i].name, n) for n in names):
                owner[pid] = i
                break
    for pid in params:  # registration order within each unit
        specs[owner[pid]].params.append(params[pid])
    return [s for s in specs if s.params or s.name == ""]
