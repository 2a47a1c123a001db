"""`report_to`: the figures of `log.jsonl` in TensorBoard's event files (read back with TensorBoard's own reader) and
in an offline W&B run under the run directory; and the bad input of evaluation and reporting, one line each."""

from __future__ import annotations

import json
import struct
import sys
import time
from pathlib import Path

import pytest

import poplar
from poplar.train.config import load_config
from poplar.train.report import read_log
from poplar.train.reporters import Reporters, scalars
from tests.helpers.caches import own_caches
from tests.helpers.refusals import refusal
from tests.helpers.user_data import text_file, write_pairs


@pytest.fixture(autouse=True)
def caches(tmp_path, monkeypatch):
    own_caches(monkeypatch, tmp_path / "caches")
    for name in ("WANDB_MODE", "WANDB_API_KEY"):   # offline: no server
        monkeypatch.delenv(name, raising=False)


def tensorboard_scalars(directory: Path) -> dict[str, dict[int, float]]:
    """Every scalar of the event files under ``directory``, by tag and step, as TensorBoard's reader gives them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def wandb_records(run_dir: Path) -> list:
    """The protobuf records of an offline W&B run, read from its ``run-<id>.wandb`` file: LevelDB's log format
    (32 KiB blocks of checksummed chunks, after W&B's 7-byte header)."""
    from wandb.proto import wandb_internal_pb2

    data = next(run_dir.glob("run-*.wandb")).read_bytes()
    assert data[:4] == b":W&B"
    pos, buf, records = 7, b"", []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:      # a block's tail too short for a chunk's header is padding
            pos += 32768 - pos % 32768
            continue
        _, size, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        buf, pos = buf + data[pos + 7:pos + 7 + size], pos + 7 + size
        if kind in (1, 4):               # a whole record, or its last chunk
            record = wandb_internal_pb2.Record()
            record.ParseFromString(buf)
            buf = b""
            records.append(record)
    return records


def wandb_history(run_dir: Path) -> list[dict]:
    """The history rows of an offline W&B run (:func:`wandb_records`)."""
    return [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            for r in wandb_records(run_dir) if r.WhichOneof("record_type") == "history"]


@pytest.mark.slow     # W&B starts its own service process
@pytest.mark.parametrize("failed", [False, True], ids=["finished", "failed"])
def test_a_wandb_run_ends_as_the_training_did(tmp_path, failed):
    from poplar.train.reporters import Wandb

    sink = Wandb(tmp_path)
    sink.write({"step": 0, "loss": 1.0})
    sink.close(failed)
    run = next((tmp_path / "wandb").glob("offline-run-*"))
    exits = [r.exit.exit_code for r in wandb_records(run) if r.WhichOneof("record_type") == "exit"]
    assert exits == [1 if failed else 0]


def test_the_figures_of_a_record_as_tensorboard_reads_them(tmp_path):
    """Every kind of figure a record holds (fp16's loss scale, MFU, a re-plan, a skipped step, each rank's times),
    written by the sink and read back by TensorBoard's reader at the steps done."""
    records = [{"step": 0, "loss": 6.5, "lr": 1e-3, "step_s": 0.5, "samples_per_s": 64.0, "tokens_per_s": 2048.0,
                "tflops": 1.5, "mfu": 0.25, "busy_s": [0.4, 0.3], "idle_s": [0.1, 0.2], "grad_norm": 2.0,
                "overruns": 0, "loss_scale": 65536.0},
               {"step": 1, "loss": None, "lr": 9e-4, "step_s": 0.4, "samples_per_s": 80.0, "tokens_per_s": 2560.0,
                "tflops": 1.8, "busy_s": [0.4, 0.4], "idle_s": [0.0, 0.0], "grad_norm": None, "overruns": 1,
                "skipped": "non-finite loss or gradient: the update was left out", "loss_scale": 32768.0,
                "replan": {"after_step": 2, "predicted_step_s": 0.3}},
               {"step": 1, "eval_loss": 5.0, "eval_perplexity": 148.4, "eval_tokens": 640, "eval_samples": 20,
                "eval_s": 0.1}]
    sink = Reporters(tmp_path, ["tensorboard"])
    for r in records:
        sink.write(r)
    sink.close()
    assert read_log(tmp_path / "log.jsonl") == records
    got = tensorboard_scalars(tmp_path / "tensorboard")
    want: dict[str, dict[int, float]] = {}
    for r in records:
        for name, value in scalars(r).items():
            want.setdefault(name, {})[r["step"] + 1] = value
    assert got.keys() == want.keys() and {"rank_1/idle_s", "loss_scale", "mfu", "replan", "eval_perplexity"} <= set(got)
    for name in want:
        assert got[name] == pytest.approx(want[name], rel=1e-6), name
    assert got["rank_1/busy_s"] == pytest.approx({1: 0.3, 2: 0.4}) and got["loss_scale"] == {1: 65536, 2: 32768}
    assert got["loss"] == {1: 6.5} and got["replan"] == {2: 1.0}      # a lost loss is left out, not a NaN


def test_a_resumed_run_s_steps_replace_the_earlier_run_s_in_tensorboard(tmp_path):
    """A run resumed from its checkpoint after step 2 logs steps 3 and 4 again: TensorBoard shows the new ones
    only, as log.jsonl keeps only the records before the checkpoint."""
    first = Reporters(tmp_path, ["tensorboard"])
    for step in range(4):
        first.write({"step": step, "loss": 10.0 + step})
    first.close()
    time.sleep(1.1)     # (event files are named by the second they are opened in)
    resumed = Reporters(tmp_path, ["tensorboard"], start=2)
    for step in (2, 3):
        resumed.write({"step": step, "loss": 20.0 + step})
    resumed.close()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(1, 10.0), (2, 11.0), (3, 22.0), (4, 23.0)]


@pytest.mark.slow
def test_a_run_reports_to_tensorboard_and_wandb_what_its_log_holds(tmp_path):
    plan = poplar.Plan.from_local_batches(3, [5, 3], 1, shard_shares=[2, 1])
    plan.save(tmp_path / "plan.json")
    cfg = load_config(None, {"model": "llama-tiny", "seq_len": 16, "vocab_size": 300, "eval_data": 0.2,
                             "eval_every": 2, "data": str(text_file(tmp_path / "train.txt", 60, 0)),
                             "global_batch": 8, "steps": 3, "cluster": "none", "plan": str(tmp_path / "plan.json"),
                             "out": str(tmp_path / "run"), "report_to": "tensorboard,wandb"})
    from poplar.train.run import run_training

    run_training(cfg, nproc=2)
    log = read_log(tmp_path / "run" / "log.jsonl")
    assert [r["step"] for r in log] == [0, 1, 1, 2, 2] and "eval_loss" in log[2] and "eval_loss" in log[4]
    want: dict[int, dict[str, float]] = {}
    for r in log:
        want.setdefault(r["step"] + 1, {}).update(scalars(r))
    names = set().union(*want.values())
    assert {"loss", "lr", "samples_per_s", "tokens_per_s", "tflops", "grad_norm", "rank_0/busy_s", "rank_1/idle_s",
            "eval_loss", "eval_perplexity", "eval_tokens"} <= names
    tb = tensorboard_scalars(tmp_path / "run" / "tensorboard")
    assert set(tb) == names
    for name in names:
        assert tb[name] == pytest.approx({s: f[name] for s, f in want.items() if name in f}, rel=1e-6), name
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    rows = {row["_step"]: row for row in wandb_history(runs[0])}
    assert sorted(rows) == [1, 2, 3]
    for step, figures in want.items():
        assert {k: rows[step][k] for k in figures} == pytest.approx(figures, rel=1e-12), step


TRAIN = ["train", "--cluster", "none", "--nproc", "2", "--plan", "{tmp}/plan.json", "--steps", "2",
         "--global-batch", "8", "--set", "seq_len=16", "--set", "vocab_size=300", "--set", "data={tmp}/train.txt",
         "--out", "{tmp}/r"]
CASES = [   # (what is wrong, options, words the one line must hold)
    ("eval_data missing", ["--eval-data", "{tmp}/nope.jsonl"], "eval_data '{tmp}/nope.jsonl': no such file"),
    ("eval_data with a field the training data lacks", ["--set", "data={tmp}/pairs.jsonl", "--eval-data",
                                                        "{tmp}/text.jsonl"],
     "eval_data '{tmp}/text.jsonl' holds documents (a 'text' field, or plain text), the training data "
     "'{tmp}/pairs.jsonl' prompt/completion pairs: give evaluation data with the training data's fields"),
    ("eval_data of no field Poplar reads", ["--eval-data", "{tmp}/bodies.jsonl"], "eval_data '{tmp}/bodies.jsonl': no"),
    ("a fraction past 1", ["--eval-data", "1.5"], "eval_data: Value error, a fraction of the training samples to hold out is "
                                                   "between 0 and 1"),
    ("a fraction that holds out nothing", ["--eval-data", "0.001"], "holds out none of the"),
    ("a fraction that leaves no global batch", ["--eval-data", "0.99"], "fewer than a global batch of 8"),
    ("eval_every without eval_data", ["--eval-every", "5"], "eval_every (5) evaluates nothing without eval_data"),
    ("report_to a name HF does not have", ["--report-to", "mlflow"], "report_to.0"),
]


@pytest.fixture
def case_dir(tmp_path):
    tmp_path = tmp_path / "cases"     # (the caches beside it)
    tmp_path.mkdir()
    poplar.Plan.from_local_batches(1, [5, 3], 1).save(tmp_path / "plan.json")
    text_file(tmp_path / "train.txt", 60, 0)
    write_pairs(tmp_path / "pairs.jsonl")
    (tmp_path / "text.jsonl").write_text("".join(json.dumps({"text": f"row {i} of text"}) + "\n" for i in range(20)))
    (tmp_path / "bodies.jsonl").write_text("".join(json.dumps({"body": f"row {i}"}) + "\n" for i in range(20)))
    return tmp_path


def refused(case_dir: Path, options: list[str]) -> str:
    """The command's one line: exit 2, under 10 s, nothing written."""
    output = refusal([*TRAIN, *options], case_dir)
    assert not (case_dir / "r").exists()
    return output


@pytest.mark.parametrize("what, options, words", CASES, ids=[c[0] for c in CASES])
def test_bad_evaluation_or_reporting_input_is_one_line_and_writes_nothing(case_dir, what, options, words):
    assert words.replace("{tmp}", str(case_dir)) in refused(case_dir, options)


@pytest.mark.parametrize("name, module", [("tensorboard", "tensorboard"), ("wandb", "wandb")])
def test_report_to_a_package_that_is_missing_names_its_extra(case_dir, monkeypatch, name, module):
    """The package's import fails (as where it is not installed): one line naming the extra, before anything."""
    for loaded in {module, "torch.utils.tensorboard", *(m for m in sys.modules if m.startswith(module + "."))}:
        monkeypatch.setitem(sys.modules, loaded, None)
    line = refused(case_dir, ["--report-to", name, "--eval-data", "0.2"])
    assert f"report_to: {name} needs the {name} package" in line and f"pip install 'poplar-zero[{name}]'" in line
