"""Bad input, every case: a one-line error naming what to change, exit code != 0, no traceback, nothing written,
in under 10 s (before anything is profiled or launched).

The table in docs/reliability.md lists the same cases with the messages they give
(``python -m tests.test_bad_input`` prints it).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import poplar
from tests.helpers.caches import own_caches
from tests.helpers.refusals import CLUSTER3, ROOT, refusal, run_case

TINY = ["--set", "seq_len=32", "--set", "vocab_size=512"]


def _setup(tmp: Path, earlier_run: Path) -> None:
    """The files the cases point at."""
    (tmp / "bad.yaml").write_text("steps: [1,\n")
    (tmp / "list.yaml").write_text("- 1\n- 2\n")
    (tmp / "unknown-gpu.yaml").write_text("devices:\n  - kind: x\n    gpu: A999\n")
    (tmp / "speed.yaml").write_text("devices:\n  - kind: x\n    speed: 2.0\n")
    (tmp / "no-devices.yaml").write_text("devices: []\n")
    (tmp / "zero-count.yaml").write_text("devices:\n  - kind: x\n    gpu: T4-16GB\n    count: 0\n")
    (tmp / "two-t4.yaml").write_text("devices:\n  - kind: t4\n    gpu: T4-16GB\n    count: 2\n")
    (tmp / "four-v100.yaml").write_text("devices:\n  - kind: v100\n    gpu: V100-16GB\n    count: 4\n")
    (tmp / "nan-tflops.yaml").write_text("devices:\n  - kind: x\n    memory_gb: 16\n    tflops: {fp32: .nan}\n"
                                         "    memory_bandwidth_gbs: 300\n")
    (tmp / "inf-bandwidth.yaml").write_text("devices:\n  - kind: x\n    memory_gb: 16\n    tflops: 10\n"
                                            "    memory_bandwidth_gbs: .inf\n")
    poplar.Plan.from_local_batches(1, [6, 4], 1).save(tmp / "plan-2.json")
    (tmp / "plan-edited.json").write_text(json.dumps({"zero_stage": 2, "micro_batch_sizes": [2, 2, 2],
                                                      "accum_steps": [1, 2, 1]}))
    (tmp / "plan-fields.json").write_text(json.dumps({"zero_stage": 1, "micro_batch_sizes": [2, 2, 2]}))
    (tmp / "plan-corrupt.json").write_text('{"zero_stage": 1, "micro')
    (tmp / "plan-other-model.json").write_text(json.dumps({
        **poplar.Plan.from_local_batches(1, [6, 4, 2], 1).to_dict(),
        "meta": {"model": {"name": "bert-tiny", "seq_len": 128}}}))
    poplar.Plan.from_local_batches(1, [6, 4, 2], 1).save(tmp / "plan-3.json")
    (tmp / "profile-corrupt.json").write_text("{not json")
    (tmp / "profile-wrong.json").write_text(json.dumps({"model": {"name": "x"}, "ranks": ["a"]}))
    (tmp / "misspelt-gpu.yaml").write_text("devices:\n  - kind: x\n    gpu: A100-80G\n  - kind: y\n    gpu: t4-16gb\n")
    (tmp / "cuda-name.yaml").write_text("devices:\n  - kind: x\n    gpu: NVIDIA H100 PCIe\n")
    (tmp / "binary.txt").write_bytes(b"PK\x03\x04\x00\x00" + bytes(range(256)))
    (tmp / "latin-1.txt").write_bytes("Caf\u00e9s and na\u00efve r\u00e9sum\u00e9s\n".encode("latin-1") * 50)
    (tmp / "empty.txt").write_text("")
    (tmp / "short.txt").write_text("just a few words\n")
    (tmp / "empty-dir").mkdir()
    (tmp / "a-file").write_text("not a directory\n")
    _your_model(tmp)
    shutil.copytree(earlier_run, tmp / "earlier")
    shutil.copytree(earlier_run, tmp / "corrupted")
    shutil.copytree(earlier_run, tmp / "finished")     # its own options in config.yaml: --resume reads them
    (tmp / "finished" / "config.yaml").write_text(f"cluster: {CLUSTER3}\nsteps: 2\nseq_len: 32\nvocab_size: 512\n"
                                                  "global_batch: 12\n")
    for shard in (tmp / "corrupted" / "checkpoints").glob("step-*/*.distcp"):
        shard.write_bytes(shard.read_bytes()[:10])


def _your_model(tmp: Path) -> None:
    """A user's model directories and data files, each wrong in one way (:mod:`tests.helpers.pretrained`)."""
    from tests.helpers.pretrained import save_classifier, save_qwen2

    save_qwen2(tmp / "qwen")
    save_classifier(tmp / "cls")
    shutil.copytree(tmp / "cls", tmp / "cls-no-pad")
    for f in (tmp / "cls-no-pad").glob("*token*"):
        f.unlink()
    no_pad = json.loads((tmp / "cls-no-pad" / "config.json").read_text())
    (tmp / "cls-no-pad" / "config.json").write_text(json.dumps({**no_pad, "pad_token_id": None}))
    (tmp / "no-config").mkdir()
    (tmp / "no-config" / "model.safetensors").write_bytes(b"")
    config = json.loads((tmp / "qwen" / "config.json").read_text())
    for name, change in (("unknown-arch", {"model_type": "qwen9"}),
                         ("token-classifier", {"architectures": ["Qwen2ForTokenClassification"]}),
                         ("other-size", {"hidden_size": 48}), ("small-vocab", {"vocab_size": 280}),
                         ("more-layers", {"num_hidden_layers": 3, "layer_types": ["full_attention"] * 3}),
                         ("fewer-layers", {"num_hidden_layers": 1, "layer_types": ["full_attention"]}),
                         ("invalid-config", {"num_hidden_layers": 3})):   # its layer_types name 2
        shutil.copytree(tmp / "qwen", tmp / name)
        (tmp / name / "config.json").write_text(json.dumps({**config, **change}))
    (tmp / "small-vocab" / "model.safetensors").unlink()    # a config alone: the tokenizer is what is wrong
    rows = [{"prompt": f"question {i}", "completion": f"answer {i}"} for i in range(40)]
    (tmp / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp / "no-answers.jsonl").write_text("".join(json.dumps({**r, "completion": ""}) + "\n" for r in rows))
    (tmp / "bodies.jsonl").write_text("".join(json.dumps({"body": r["prompt"]}) + "\n" for r in rows))
    (tmp / "long.jsonl").write_text("".join(json.dumps({"input_ids": list(range(200))}) + "\n" for _ in rows))
    (tmp / "text.parquet").write_text("this is text, not parquet\n" * 20)
    (tmp / "labels.jsonl").write_text("".join(json.dumps({"text": f"row {i}", "label": i % 8}) + "\n" for i in range(40)))
    (tmp / "full-dir").mkdir()
    (tmp / "full-dir" / "keep.txt").write_text("the user's file\n")


def _yours(model: str, *args):
    return ["train", "--cluster", CLUSTER3, "--steps", "2", "--model", f"{{tmp}}/{model}", "--set", "seq_len=32",
            *args, "--out", "{tmp}/r"]


def _train(*args):
    return ["train", "--cluster", CLUSTER3, "--steps", "2", *TINY, *args]


# (what is wrong, command line with {tmp} for the case directory, words the one line must hold, exit code)
CASES = [
    # config files and overrides
    ("a field out of range", _train("--set", "lr=0", "--out", "{tmp}/r"), "lr: Input should be greater than 0", 2),
    ("an unknown field", _train("--set", "colour=red", "--out", "{tmp}/r"), "colour: unknown field", 2),
    ("--set without =", _train("--set", "lr", "--out", "{tmp}/r"), "write field=value", 2),
    ("--set with a value that is not YAML", _train("--set", "stages=[0, 1", "--out", "{tmp}/r"),
     "--set 'stages=[0, 1': the value is not YAML", 2),
    ("a missing config file", _train("--config", "{tmp}/nope.yaml", "--out", "{tmp}/r"), "no such file", 2),
    ("a config file that is not YAML", _train("--config", "{tmp}/bad.yaml", "--out", "{tmp}/r"),
     "not valid YAML", 2),
    ("a config file that is a list", _train("--config", "{tmp}/list.yaml", "--out", "{tmp}/r"),
     "expected a mapping of fields", 2),
    ("a ZeRO stage that does not exist", _train("--set", "stages=[0,7]", "--out", "{tmp}/r"),
     "choose stages from 0, 1, 2, 3", 2),
    ("stop_at past steps", _train("--set", "stop_at=9", "--out", "{tmp}/r"), "stop at or before the last step", 2),
    ("an unknown model", _train("--model", "gpt-17", "--out", "{tmp}/r"), "gpt-17", 2),
    ("an unknown baseline", _train("--baseline", "fastest", "--out", "{tmp}/r"), "baseline", 2),
    # cluster files
    ("a cluster file that does not exist", ["train", "--cluster", "{tmp}/nope.yaml", *TINY, "--out", "{tmp}/r"],
     "nope.yaml", 2),
    ("a GPU the catalogue does not know", ["train", "--cluster", "{tmp}/unknown-gpu.yaml", *TINY, "--out", "{tmp}/r"],
     "A999", 2),
    ("the old speed field", ["train", "--cluster", "{tmp}/speed.yaml", *TINY, "--out", "{tmp}/r"], "speed", 2),
    ("a cluster of no devices", ["train", "--cluster", "{tmp}/no-devices.yaml", *TINY, "--out", "{tmp}/r"],
     "devices", 2),
    ("a device count of 0", ["train", "--cluster", "{tmp}/zero-count.yaml", *TINY, "--out", "{tmp}/r"], "count", 2),
    ("a device's TFLOP/s not a number", ["profile", "--cluster", "{tmp}/nan-tflops.yaml", "--out", "{tmp}/p.json"],
     "devices.0.tflops", 2),
    ("a model whose states the whole cluster cannot hold", ["simulate", "--cluster", "{tmp}/two-t4.yaml", "--model",
     "llama-70b", "--global-batch", "64"], "more than the 2 devices of this cluster hold together", 2),
    ("bf16 on cards without it (V100)", ["simulate", "--cluster", "{tmp}/four-v100.yaml", "--mixed-precision", "bf16",
                                         "--model", "tiny", "--global-batch", "64"], "v100 (V100-16GB) has no bf16 hardware: train in fp16", 2),
    ("bf16 on cards without it (T4), training", _train("--set", "mixed_precision=bf16", "--out", "{tmp}/r"),
     "t4-16gb (T4-16GB) has no bf16 hardware: train in fp16", 2),
    ("bf16 on cards without it, profiled", ["profile", "--cluster", "{tmp}/four-v100.yaml", "--mixed-precision", "bf16",
                                            "--out", "{tmp}/p.json"], "has no bf16 hardware", 2),
    ("bf16 on cards without it, benchmarked", ["bench", "--cluster", "compute-differs", "--mixed-precision", "bf16"],
     "have no bf16 hardware", 2),
    ("a device's bandwidth infinite", ["bench", "--cluster", "{tmp}/inf-bandwidth.yaml"],
     "devices.0.memory_bandwidth_gbs", 2),
    ("a misspelt GPU name", ["train", "--cluster", "{tmp}/misspelt-gpu.yaml", *TINY, "--out", "{tmp}/r"],
     "unknown GPU 'A100-80G': did you mean A100-80GB", 2),
    ("a CUDA device name for a catalogue name", ["profile", "--cluster", "{tmp}/cuda-name.yaml", "--out",
                                                 "{tmp}/p.json"], "did you mean H100-PCIe", 2),
    ("a preset that does not exist", ["bench", "--cluster", "both-differs"], "no cluster file 'both-differs'", 2),
    # plans
    ("a plan for another world size", _train("--plan", "{tmp}/plan-2.json", "--out", "{tmp}/r"),
     "plan is for 2 ranks", 2),
    ("a hand-edited plan whose stage needs equal accumulation", _train("--plan", "{tmp}/plan-edited.json",
                                                                        "--out", "{tmp}/r"),
     "same number of accumulation steps", 2),
    ("a plan missing a field", _train("--plan", "{tmp}/plan-fields.json", "--out", "{tmp}/r"), "accum_steps", 2),
    ("a plan that is not JSON", _train("--plan", "{tmp}/plan-corrupt.json", "--out", "{tmp}/r"), "not valid JSON", 2),
    ("a plan made for another model", _train("--plan", "{tmp}/plan-other-model.json", "--out", "{tmp}/r"),
     "planned for bert-tiny", 2),
    ("a plan and a global batch that differ", _train("--plan", "{tmp}/plan-3.json", "--global-batch", "64",
                                                      "--out", "{tmp}/r"), "give one of them", 2),
    ("a plan file that does not exist", _train("--plan", "{tmp}/nope.json", "--out", "{tmp}/r"), "no such file", 2),
    # profiles
    ("a profile that is not JSON", ["plan", "--profile", "{tmp}/profile-corrupt.json", "--global-batch", "8",
                                    "--out", "{tmp}/p.json"], "profile-corrupt.json", 2),
    ("a profile missing its fields", ["plan", "--profile", "{tmp}/profile-wrong.json", "--global-batch", "8",
                                      "--out", "{tmp}/p.json"], "profile-wrong.json", 2),
    ("a profile that does not exist", ["plan", "--profile", "{tmp}/nope.json", "--global-batch", "8",
                                       "--out", "{tmp}/p.json"], "nope.json", 2),
    # data
    ("a data path that does not exist", _train("--set", "data={tmp}/nope.txt", "--out", "{tmp}/r"),
     "no such file or directory", 2),
    ("an empty text", _train("--set", "data={tmp}/empty.txt", "--out", "{tmp}/r"), "the text is empty", 2),
    ("a text shorter than one sequence", _train("--set", "data={tmp}/short.txt", "--out", "{tmp}/r"),
     "fewer than one sequence", 2),
    ("a data directory with no text", _train("--set", "data={tmp}/empty-dir", "--out", "{tmp}/r"), "no .txt file", 2),
    ("a data file that is binary", _train("--set", "data={tmp}/binary.txt", "--out", "{tmp}/r"),
     "is a binary file, not text", 2),
    ("a data file that is not UTF-8", _train("--set", "data={tmp}/latin-1.txt", "--out", "{tmp}/r"),
     "is not UTF-8 text (byte 3 is 0xe9): convert it to UTF-8", 2),
    # known from the command line and the cluster file: refused before anything is profiled
    ("a global batch smaller than the ranks", ["train", "--cluster", "uneven-quantity", "--global-batch", "2",
                                               *TINY, "--out", "{tmp}/r"], "smaller than the 4 ranks", 2),
    ("bench: a global batch smaller than the ranks", ["bench", "--cluster", "uneven-quantity", "--global-batch", "2"],
     "global batch 2 is smaller than the 4 ranks", 2),
    ("demo: a global batch smaller than the ranks", ["demo", "--cluster", "uneven-quantity", "--global-batch", "3",
                                                     "--out", "{tmp}/r"], "global batch 3 is smaller than the 4", 2),
    ("demo: a cluster that does not exist", ["demo", "--cluster", "{tmp}/nope.yaml", "--out", "{tmp}/r"],
     "no cluster file", 2),
    ("demo: --out that is a file", ["demo", "--out", "{tmp}/a-file"], "is a file", 2),
    ("demo: an unknown real model", ["demo", "--real-model", "gpt-17", "--out", "{tmp}/r"],
     "--real-model: model 'gpt-17': choose one of", 2),
    ("bench: an unknown model", ["bench", "--cluster", "both-differ", "--model", "gpt-17"],
     "model 'gpt-17': choose one of", 2),
    ("bench: no cluster named", ["bench", "--cluster", ","], "--cluster ','", 2),
    ("bench: --json into a missing directory", ["bench", "--cluster", "both-differ", "--json", "{tmp}/no/b.json"],
     "no directory", 2),
    ("plan: --out into a missing directory", ["plan", "--profile", "{tmp}/profile-corrupt.json", "--global-batch",
                                              "8", "--out", "{tmp}/no/p.json"], "no directory", 2),
    ("plan: a ZeRO stage that does not exist", ["plan", "--profile", "{tmp}/profile-corrupt.json", "--global-batch",
                                                "8", "--stages", "0,9", "--out", "{tmp}/p.json"],
     "--stages: choose stages from 0, 1, 2, 3", 2),
    ("profile: a ZeRO stage that does not exist", ["profile", "--cluster", "both-differ", "--stages", "1,4",
                                                   "--out", "{tmp}/p.json"], "choose stages from 0, 1, 2, 3", 2),
    # run directories and checkpoints
    ("a run directory holding a run, without --resume", _train("--out", "{tmp}/earlier"), "already holds a run", 2),
    ("--resume with no run there", _train("--resume", "--out", "{tmp}/empty-dir"), "holds no run to continue", 2),
    ("--out that is a file", _train("--out", "{tmp}/a-file"), "is a file", 2),
    ("--resume from a checkpoint of another model", _train("--model", "bert-tiny", "--resume", "--steps", "4",
                                                           "--out", "{tmp}/earlier"), "resume with the same workload", 2),
    ("--resume holding out another fraction than the run did",
     _train("--resume", "--steps", "4", "--global-batch", "12", "--eval-data", "0.1", "--out", "{tmp}/earlier"),
     "was written with data = 'embedded', this run has 'embedded (0.1 held out)'", 2),
    ("--resume where every checkpoint is corrupted", _train("--resume", "--steps", "4", "--out", "{tmp}/corrupted"),
     "no intact checkpoint", 2),
    ("--resume of a run that has trained its steps (read from its config.yaml)", ["train", "--resume", "--out",
                                                                                  "{tmp}/finished"],
     "has trained 2 steps already, and steps is 2: give --steps more than 2", 2),
    # contradicting command lines
    ("--nproc against the cluster file", _train("--nproc", "2", "--out", "{tmp}/r"), "describes 3 devices", 2),
    ("a model directory with no config", _yours("no-config"), "has no config.json", 2),
    ("a factory that cannot be imported", _train("--model", "nopkg.models:make", "--out", "{tmp}/r"),
     "module 'nopkg.models' cannot be imported", 2),
    ("a factory that returns no module", _train("--model", "tests.helpers.pretrained:factory_not_a_module", "--out",
                                                "{tmp}/r"), "returned str, not an nn.Module", 2),
    ("a factory's module whose output is no logits", _train("--model", "tests.helpers.pretrained:factory_no_logits",
                                                            "--out", "{tmp}/r"), "read as logits", 2),
    ("a model directory that does not exist", ["simulate", "--cluster", "both-differ", "--model", "{tmp}/nope/",
                                               "--global-batch", "8"], "no such directory", 2),
    ("an architecture transformers cannot build", _yours("unknown-arch"), "transformers cannot read", 2),
    ("a config its own validators refuse", _yours("invalid-config"), "transformers cannot read its config.json", 2),
    ("an architecture Poplar does not train", _yours("token-classifier"), "Poplar trains causal-LM", 2),
    ("a classifier with no padding token", _yours("cls-no-pad", "--data", "{tmp}/labels.jsonl"),
     "needs a padding token", 2),
    ("a label past the classifier's labels", _yours("cls", "--data", "{tmp}/labels.jsonl"),
     "the model has 3 labels", 2),
    ("a classifier's data without labels", _yours("cls", "--data", "{tmp}/pairs.jsonl"),
     "rows of a text and a label", 2),
    ("weights of another size than the config", _yours("other-size"), "in the weights and", 2),
    ("weights that lack some of the model's tensors", _yours("more-layers"), "the weights lack 12 tensor(s)", 2),
    ("weights with tensors the model has not", _yours("fewer-layers"), "the config's model has not", 2),
    ("a tokenizer larger than the model's vocabulary", _yours("small-vocab"), "the tokenizer gives 300 ids", 2),
    ("a data field that does not exist", _yours("qwen", "--data", "{tmp}/pairs.jsonl", "--set",
                                                "data_fields.text=body"), "no field 'body'", 2),
    ("a table of no field Poplar knows", _yours("qwen", "--data", "{tmp}/bodies.jsonl"), "no 'text'", 2),
    ("a file not of its extension's format", _yours("qwen", "--data", "{tmp}/text.parquet"),
     "cannot be read as .parquet", 2),
    ("samples longer than the model's positions", _yours("qwen", "--data", "{tmp}/long.jsonl"),
     "longer than the model's 128 positions", 2),
    ("a completion field empty everywhere", _yours("qwen", "--data", "{tmp}/no-answers.jsonl"),
     "empty in every row", 2),
    ("--export into a directory that holds files", _yours("qwen", "--export", "{tmp}/full-dir"),
     "already holds files", 2),
    ("export of a directory that holds no run", ["export", "{tmp}/empty-dir", "--out", "{tmp}/exported"],
     "no checkpoints", 2),
    ("plain CPU ranks without a plan", ["train", "--cluster", "none", *TINY, "--out", "{tmp}/r"],
     "--nproc with --plan", 2),
]


def _earlier_run(run: Path) -> None:
    """A run directory as `poplar train` leaves it (llama-tiny, 12 samples a step, checkpointed at step 2)."""
    from poplar.processes.spawn import spawn
    from tests.train.checkpoint_workers import write_checkpoint

    meta = {"workload": {"model": "llama-tiny", "seq_len": 32, "vocab_size": 512, "activation_checkpointing": False},
            "global_batch": 12, "seed": 0,
            "data": "embedded"}
    spawn(write_checkpoint, 1, str(run / "checkpoints"), meta, timeout_s=120)
    (run / "log.jsonl").write_text("".join(json.dumps({"step": i, "loss": 6.0}) + "\n" for i in range(2)))


@pytest.fixture(scope="module")
def cases_dir(starts_processes, tmp_path_factory):
    """An earlier run to point the checkpoint cases at, and the case files."""
    tmp = tmp_path_factory.mktemp("bad-input")
    _earlier_run(tmp / "run")
    cases = tmp / "cases"
    cases.mkdir()
    _setup(cases, tmp / "run")
    return cases


@pytest.fixture(autouse=True)
def caches(tmp_path_factory, monkeypatch):
    own_caches(monkeypatch, tmp_path_factory.getbasetemp() / "bad-input-caches")


@pytest.mark.parametrize("what, args, words, code", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_one_line_and_changes_nothing(cases_dir, what, args, words, code):
    output = refusal(args, cases_dir, code)
    assert words in output, output
    assert not (cases_dir / "r").exists() and not (cases_dir / "p.json").exists()


def test_there_are_at_least_25_cases():
    assert len(CASES) >= 25 and len({c[0] for c in CASES}) == len(CASES)


def main() -> None:
    """Print the table of docs/reliability.md: every case (or those whose names hold an argument's words)."""
    import os
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        os.environ.update(POPLAR_DATA_CACHE=str(tmp / "data"), POPLAR_CACHE_DIR=str(tmp / "profiles"),
                          POPLAR_DILATION="3", COLUMNS="300")
        _earlier_run(tmp / "run")
        cases = tmp / "cases"
        cases.mkdir()
        _setup(cases, tmp / "run")
        print("| what is wrong | command (`poplar ...`) | the line it prints | exit |\n|---|---|---|---|")
        for what, args, _, _ in CASES:
            if len(sys.argv) > 1 and not any(word in what for word in sys.argv[1:]):   # only the cases named
                continue
            code, output, _ = run_case(args, cases)
            shown = " ".join(a.replace("{tmp}/", "").replace(str(ROOT) + "/", "") for a in args)
            line = output.replace(str(cases) + "/", "").replace(str(cases), ".").replace("|", "\\|")
            print(f"| {what} | `{shown}` | {line} | {code} |")


if __name__ == "__main__":
    main()
