"""A comparison's result, one value for every command: its figures, the JSON the commands write, read back whole."""

import doctest
import json

import poplar.compare.comparison
from poplar.compare.comparison import Comparison, Contender, Measured
from poplar.plan import Plan


def _measured_comparison() -> Comparison:
    """As `poplar bench` makes one: every allocation measured (one with another's plan, one that failed), a peer."""
    poplar = Contender("poplar", Plan(0, [12, 4], 1), 190.0, 16 / 190, Measured(200.0, 0.08, [0.08, 0.07], 1))
    uniform = Contender("uniform", Plan(0, [8, 8], 1), 100.0, 0.16, Measured(100.0, 0.16, [0.1, 0.16], 2,
                                                                               alone="rank 1: out of memory"))
    proportional = Contender("proportional", poplar.plan, 190.0, 16 / 190, poplar.measured, same_plan_as="poplar")
    peak = Contender("measured-peak", Plan(0, [14, 2], 1), 120.0, 16 / 120, failed="rank 0: OutOfMemoryError")
    deepspeed = Contender("deepspeed", setup={"version": "0.19", "micro_batch_size": 4, "global_batch": 16},
                          measured=Measured(80.0, 0.2, [0.2, 0.2], 3), failed_before=("OutOfMemoryError at 8",))
    return Comparison(model="llama-tiny", cluster="both-differ", world_size=2, seq_len=32, global_batch=16,
                      zero_stage=0, shape="flat", label="stage 0", reason="stage 0: the fastest",
                      ideal_samples_per_s=250.0, allocations=(poplar, uniform, proportional, peak),
                      peers={"deepspeed": deepspeed, "other": "not installed"})


def test_the_figures_are_the_measured_ones_where_measured():
    c = _measured_comparison()
    assert c.poplar.samples_per_s == 200.0 and c.poplar.prediction_error == (16 / 190) / 0.08 - 1
    assert c.allocation("measured-peak").samples_per_s is None       # it failed: no figure, not the prediction
    assert c.allocation("deepspeed").samples_per_s == 80.0 and c.allocation("other") is None
    assert c.speedup(c.allocation("uniform").samples_per_s) == 2.0
    assert c.overruns == 1 + 2 + 3      # the plan measured once is counted once
    assert str(c) == ("llama-tiny on both-differ, global batch 16, stage 0: poplar 200.0 samples/s, 2.00x uniform, "
                      "1.00x proportional, 2.50x deepspeed, 80% of the ideal bound")


def test_its_json_holds_what_the_commands_have_always_written_and_reads_back_whole():
    c = _measured_comparison()
    d = json.loads(json.dumps(c.to_dict()))
    # bench's fields
    assert (d["poplar_vs_uniform"], d["poplar_vs_proportional"], d["poplar_vs_measured_peak"],
            d["poplar_vs_deepspeed"]) == (2.0, 1.0, None, 2.5)
    assert d["poplar_of_ideal"] == 0.8 and d["ideal_tokens_per_s"] == 250.0 * 32 and d["overruns"] == 6
    rows = d["allocations"]
    assert rows["uniform"]["tokens_per_s"] == 100.0 * 32 and rows["uniform"]["measured_alone"].startswith("rank 1")
    assert rows["proportional"]["same_plan_as"] == "poplar" and rows["measured-peak"]["failed"].startswith("rank 0")
    assert "samples_per_s" not in rows["measured-peak"]
    assert d["peers"]["deepspeed"]["version"] == "0.19" and d["peers"]["deepspeed"]["failed_before"] == [
        "OutOfMemoryError at 8"] and d["peers"]["other"] == "not installed"
    # simulate's
    assert d["samples_per_s"] == 200.0 and d["baselines"] == {"uniform": 100.0, "proportional": 200.0,
                                                              "measured-peak": None} and d["alone"] == []
    assert Comparison.from_dict(d) == c


def test_each_kind_alone_is_a_contender_of_its_own():
    a100 = Contender("a100 alone", Plan(0, [16], 1), 90.0, 16 / 90, kind="a100", ranks=1, label="stage 0")
    t4 = Contender("t4 alone", kind="t4", ranks=1, why_not="cannot hold the model")
    c = Comparison(model="tiny", cluster="a100 + t4", world_size=2, seq_len=64, global_batch=16, zero_stage=0,
                   shape="flat", label="stage 0", reason="", ideal_samples_per_s=120.0,
                   allocations=(Contender("poplar", Plan(0, [12, 4], 1), 110.0), a100, t4))
    assert c.alone == [a100, t4] and c.baselines == []
    d = c.to_dict()
    assert d["alone"] == [{"kind": "a100", "ranks": 1, "label": "stage 0", "samples_per_s": 90.0, "why_not": ""},
                          {"kind": "t4", "ranks": 1, "label": "", "samples_per_s": None,
                           "why_not": "cannot hold the model"}]
    assert d["overruns"] is None and Comparison.from_dict(d) == c      # nothing measured


def test_the_module_s_example():
    failed, tried = doctest.testmod(poplar.compare.comparison)
    assert tried and not failed
