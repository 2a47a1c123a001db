"""A deep model's step drawn from two shallow ones (poplar.simulate.layers): exactly the step of the deep model."""

import dataclasses

import pytest

from poplar.cluster.spec import parse_cluster
from poplar.engine.config import EngineConfig
from poplar.profile.options import ProfileOptions
from poplar.profile.timing import RankRun
from poplar.simulate import profile as simulated
from poplar.simulate import recording
from poplar.simulate.fake import fake_tensors
from poplar.simulate.layers import SHALLOW, Shallow, deeper, deeper_units, layers_of, shallowest
from poplar.simulate.trace import CountingDevice
from poplar.models.workload import Workload

CLUSTER = {"network": {"inter_node": {"bandwidth_gbs": 25, "latency_us": 5}},
           "devices": [{"kind": "a", "gpu": "A100-80GB", "count": 4, "gpus_per_node": 2},
                       {"kind": "t", "gpu": "T4-16GB", "count": 2, "gpus_per_node": 2}]}
# families, unit sizes (a layer one unit, or several), activation checkpointing, mixed precision, every stage:
# each model in a stage of its own, ZeRO-3 (its prefetches) twice (the whole space, 4 x 4: 50 s)
CASES = [("llama-125m", 6, False, "bf16"), ("llama-125m", 7, True, "fp32"), ("bert-base", 6, False, "bf16"),
         ("llama-350m", 5, True, "fp16")]
PAIRS = [(case, i) for i, case in enumerate(CASES)] + [(CASES[2], 3)]
# each drawn from the fewest layers its stage allows, and (where that is fewer) from SHALLOW, where a failed check
# at the fewest goes
DEPTHS = [(case, stage, d) for case, stage in PAIRS for d in sorted({shallowest(stage), SHALLOW})]


def _traces(source, depths, stage, precision, sizes):
    spec = parse_cluster(CLUSTER)
    config = EngineConfig(mixed_precision=precision, check_batches=False)
    with fake_tensors():
        device = CountingDevice(spec, 0)
        with device:
            out = {}
            for d in depths:
                run = RankRun(device, 0, spec.world_size, Shallow(source, d), config, warmup=1, repeats=1)
                made = recording.Recording(run, stage)
                out[d] = ({k: made.trace(*k) for k in sizes}, made)
            return out


@pytest.mark.parametrize("case, stage, depth", DEPTHS)
def test_a_deep_step_drawn_from_two_shallow_ones_is_the_deep_models_to_the_last_operator(case, stage, depth):
    """Every operator's FLOPs, bytes and dtype, every mark, launch and wait, and the model states, at one and two
    samples and two micro-batches, for every stage: as recorded on the model of ``layers`` layers."""
    model, layers, checkpointed, precision = case
    wl = Workload(model=model, seq_len=16, activation_checkpointing=checkpointed)
    sizes = [(1, 1), (2, 1), (1, 2)]
    got = _traces(wl, (depth, depth + 1, layers), stage, precision, sizes)
    (a, ra), (b, rb), (deep, rd) = got[depth], got[depth + 1], got[layers]
    for k in sizes:
        drawn = deeper(a[k], b[k], layers, depth)
        assert drawn is not None and drawn.same_as(deep[k]), k
        assert drawn.marks == deep[k].marks and drawn.launches == deep[k].launches and drawn.waits == deep[k].waits
    assert deeper_units(ra.units, rb.units, layers - depth) == rd.units
    extra = layers - depth
    for field in ("before", "most", "sharded"):
        assert getattr(ra, field) + extra * (getattr(rb, field) - getattr(ra, field)) == getattr(rd, field)


def test_steps_that_are_not_one_with_runs_inserted_are_not_drawn():
    """A step is drawn only where the deeper one is the shallower with runs inserted: not from two alike steps,
    nor from a deeper one against a shallower, nor where an operator of the shallower is not in the deeper."""
    wl = Workload(model="llama-125m", seq_len=16)
    got = _traces(wl, (SHALLOW, SHALLOW + 1), 2, "bf16", [(1, 1), (1, 2)])
    a, b = got[SHALLOW][0], got[SHALLOW + 1][0]
    assert deeper(a[(1, 1)], a[(1, 1)], 6, SHALLOW) is None             # no layer's units between them
    assert deeper(b[(1, 1)], a[(1, 1)], 6, SHALLOW) is None             # fewer units, not more
    other = b[(1, 1)].dtypes.copy()
    other[:3] = (other[:3] + 1) % 3
    assert deeper(a[(1, 1)], dataclasses.replace(b[(1, 1)], dtypes=other), 6, SHALLOW) is None   # a's not in b
    assert deeper_units((1, 2, 3), (1, 5, 2, 3), 3) == (1, 5, 5, 5, 2, 3)
    assert deeper_units((1, 2, 3), (1, 5, 9, 3), 3) is None


def test_a_source_without_fewer_layers_is_run_as_it_is():
    from poplar.models.factory import FactorySource

    assert layers_of(Workload(model="tiny")) is None                    # TinyCausalLM: run whole
    assert layers_of(Workload(model="llama-7b")) == 32
    assert layers_of(Shallow(Workload(model="llama-7b"), 6)) == 6
    assert not hasattr(FactorySource, "build_layers")


def _drawn_and_whole(wl, options, cluster, monkeypatch, expect=None):
    """The stages simulated with ``wl``'s deep steps drawn from shallow ones (every drawing checked and kept; or
    as ``expect`` says, by depth), and again on the whole model."""
    def fresh():
        for memo in (recording.COUNTED, recording.SHARED, simulated.SAVED, recording.DRAWN):
            memo.clear()
    fresh()
    drawn = simulated.simulate_stages(wl, cluster, options)
    if expect is None:
        assert all(recording.DRAWN.values()) and recording.DRAWN
    else:
        assert {key[-1]: kept for key, kept in recording.DRAWN.items()} == expect
    fresh()
    with monkeypatch.context() as m:
        m.setattr(simulated, "layers_of", lambda source: None)
        m.setattr(recording, "layers_of", lambda source: None)
        whole = simulated.simulate_stages(wl, cluster, options)
    fresh()
    assert drawn.keys() == whole.keys()
    for key in drawn:
        assert drawn[key].model_dump() == whole[key].model_dump(), key
    return drawn


def test_the_simulated_profile_drawn_from_shallow_steps_is_the_one_run_on_the_whole_model(monkeypatch):
    """The whole procedure (states, largest micro-batch, timed points, anatomy, steps at unlike shares) on a
    model of 5 layers: drawn from 1 and 2 (checked at 3), against the same run on all 5."""
    wl = Shallow(Workload(model="llama-125m", seq_len=32), 5)
    options = ProfileOptions(stages=(2,), n_points=2, max_micro_batch=4, precision="fp16")
    drawn = _drawn_and_whole(wl, options, {**CLUSTER, "memory_scale": 0.02}, monkeypatch)
    assert any(sp.share_steps for sp in drawn.values())      # the unlike shares' steps were drawn too
    assert {sp.max_micro_batch for sp in drawn.values()} != {0}


def test_a_drawing_that_fails_its_check_is_drawn_from_one_layer_more(monkeypatch):
    """A drawing from one layer whose check fails (made to): the steps are drawn from two layers instead (checked
    at four), and the profile is the one run on the whole model."""
    from poplar.simulate.layers import DeepRecording

    wl = Shallow(Workload(model="llama-125m", seq_len=32), 5)
    options = ProfileOptions(stages=(1,), n_points=2, max_micro_batch=4, precision="fp16")
    real = DeepRecording.steps_match
    monkeypatch.setattr(DeepRecording, "steps_match", lambda self, c: self.shallow > 1 and real(self, c))
    assert shallowest(1) == 1
    _drawn_and_whole(wl, options, CLUSTER, monkeypatch, expect={1: False, 2: True})


def _config_only(directory, family: str):
    """A config.json of 5 layers 768 wide (as small real models are: a step's operators of unlike kinds then differ
    in size, which the drawing's diff aligns by), no weights: the simulator builds on fake tensors."""
    import transformers as tf

    small = dict(vocab_size=320, num_hidden_layers=5, num_attention_heads=4, max_position_embeddings=128)
    config = {"qwen2": lambda: tf.Qwen2Config(hidden_size=768, intermediate_size=1536, num_key_value_heads=2,
                                              architectures=["Qwen2ForCausalLM"], **small),
              "gpt2": lambda: tf.GPT2Config(n_embd=768, n_layer=5, n_head=4, n_positions=128, vocab_size=320,
                                            architectures=["GPT2LMHeadModel"]),
              "bert": lambda: tf.BertConfig(hidden_size=768, intermediate_size=1536, architectures=["BertForMaskedLM"],
                                            **small)}[family]()
    config.save_pretrained(directory)
    return directory


@pytest.mark.parametrize("family, stage", [("qwen2", 3), ("gpt2", 2), ("bert", 1)])
def test_a_model_directory_is_drawn_from_shallow_steps_as_a_preset_is(tmp_path, monkeypatch, family, stage):
    """A user's own Hugging Face directory of 5 alike layers (a causal LM of the Llama line, GPT-2's Conv1D
    layers and tied head, a masked LM): its simulated profile drawn from 1 and 2 layers (ZeRO-3: 2 and 3), as
    run on all 5."""
    from poplar.models.pretrained import ModelDirectory

    wl = ModelDirectory(directory=str(_config_only(tmp_path / "m", family)), seq_len=16)
    assert layers_of(wl) == 5 and sum(p.numel() for p in wl.build_layers(5).parameters()) == wl.n_params()
    options = ProfileOptions(stages=(stage,), n_points=2, max_micro_batch=4, precision="fp16")
    drawn = _drawn_and_whole(wl, options, {**CLUSTER, "memory_scale": 0.01}, monkeypatch)
    assert {sp.max_micro_batch for sp in drawn.values()} != {0}


def test_a_directory_whose_layers_differ_by_a_setting_is_run_whole(tmp_path):
    """Layers told apart by a setting of one value a layer (Qwen2's sliding window from its fourth layer on) are
    not alike: such a model is not drawn from shallow ones; where every layer's value is alike, it is."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from poplar.models.pretrained import ModelDirectory

    for name, window in (("alike", {}), ("unlike", {"use_sliding_window": True, "sliding_window": 8,
                                                    "max_window_layers": 3})):
        config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, **window)
        Qwen2ForCausalLM(config).save_pretrained(tmp_path / name)
    assert layers_of(ModelDirectory(directory=str(tmp_path / "alike"), seq_len=16)) == 6
    assert layers_of(ModelDirectory(directory=str(tmp_path / "unlike"), seq_len=16)) is None
    shallow = ModelDirectory(directory=str(tmp_path / "alike"), seq_len=16).build_layers(2)
    assert shallow.config.num_hidden_layers == 2 and len(shallow.model.layers) == 2


@pytest.mark.parametrize("source", ["llama-125m", "bert-base", "lora", "gpt2"])
def test_the_model_info_drawn_from_shallow_models_is_the_whole_models(tmp_path, source):
    """What the profile says of a model (parameters, frozen ones, each unit's parameters and forward FLOPs), drawn
    from the model with one layer and two: the very figures of the model built whole; where a drawing does not
    check, the whole model's."""
    from poplar.engine.config import EngineConfig
    from poplar.models.lora import LoraSettings, LoraSource
    from poplar.models.pretrained import ModelDirectory
    from poplar.profile.profiler import model_info

    wl = {"llama-125m": lambda: Workload(model="llama-125m", seq_len=32, activation_checkpointing=True),
          "bert-base": lambda: Workload(model="bert-base", seq_len=32),
          "lora": lambda: LoraSource(Workload(model="llama-125m", seq_len=32), LoraSettings(r=4, targets=["q_proj"])),
          "gpt2": lambda: ModelDirectory(directory=str(_config_only(tmp_path / "m", "gpt2")), seq_len=16)}[source]()
    config = EngineConfig(mixed_precision="bf16")
    with fake_tensors():
        drawn, whole = simulated.drawn_model_info(wl, "bf16", config), model_info(wl, "bf16", config)
    assert layers_of(wl) >= 5 and drawn == whole and (drawn.frozen_params > 0) == (source == "lora")
    with fake_tensors(), pytest.MonkeyPatch.context() as m:    # a drawing that does not check: the whole model's
        m.setattr(simulated, "deeper_info", lambda a, b, layers, depth: None)
        assert simulated.drawn_model_info(wl, "bf16", config) == whole
