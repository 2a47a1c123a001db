"""When a run plans again (:class:`poplar.runtime.replanner.ReplanConfig`), from whatever a front end was given
(:func:`~poplar.runtime.replanner.replan_config`), as the integrations' ``replan=`` and ``poplar train``'s
``replan:`` section (tests/train/test_replan.py) give it."""

import pytest

from poplar.runtime.replan_settings import ReplanConfig, replan_config


@pytest.mark.parametrize("given, mode", [(None, "auto"), ("off", "off"), ("auto", "auto"), (False, "off"),
                                         (True, "auto"), ({"mode": "off"}, "off"), ({"patience": 5}, "auto")])
def test_every_front_ends_forms_give_the_same_settings(given, mode):
    got = replan_config(given)
    assert got.mode == mode and got == ReplanConfig.model_validate({} if given is None else given)
    assert replan_config(got) is got                                  # settings already made pass as they are


@pytest.mark.parametrize("given, says", [("sometimes", "replan.mode: Input should be 'auto' or 'off'"),
                                         ({"patience": 0}, "replan.patience: Input should be greater than or equal"),
                                         ({"often": 1}, "replan.often: Extra inputs are not permitted")])
def test_a_wrong_value_is_refused_in_one_line_naming_the_field(given, says):
    with pytest.raises(ValueError) as e:
        replan_config(given)
    assert says in str(e.value) and "\n" not in str(e.value)
