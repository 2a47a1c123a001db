"""What arithmetic refuses is refused before torch is imported (two seconds of a refusal otherwise): a cluster file's
figures, a model preset whose states the whole cluster cannot hold. Each command runs in a fresh interpreter, which
then says whether torch was imported."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PROBE = """
import json, sys
from typer.testing import CliRunner
from poplar.cli.main import app
r = CliRunner().invoke(app, sys.argv[1:])
print(json.dumps({"code": r.exit_code, "out": " ".join(r.output.split()), "torch": "torch" in sys.modules}))
"""


@pytest.fixture
def files(tmp_path):
    (tmp_path / "nan.yaml").write_text("devices:\n  - kind: x\n    memory_gb: 16\n    tflops: {fp32: .nan}\n"
                                       "    memory_bandwidth_gbs: 300\n")
    (tmp_path / "two-t4.yaml").write_text("devices:\n  - kind: t4\n    gpu: T4-16GB\n    count: 2\n")
    return tmp_path


@pytest.mark.parametrize("args, says", [
    (["profile", "--cluster", "{tmp}/nan.yaml", "--out", "{tmp}/p.json"], "devices.0.tflops: every TFLOP/s figure"),
    (["train", "--cluster", "{tmp}/nan.yaml", "--steps", "2", "--out", "{tmp}/r"], "devices.0.tflops"),
    (["bench", "--cluster", "both-differ,{tmp}/nan.yaml"], "devices.0.tflops"),
    (["simulate", "--cluster", "{tmp}/nan.yaml", "--model", "llama-7b", "--global-batch", "8"], "devices.0.tflops"),
    (["simulate", "--cluster", "{tmp}/two-t4.yaml", "--model", "llama-70b", "--global-batch", "64"],
     "llama-70b has 68.98B parameters: its model states take at least 1027.8 GiB in ZeRO-3"),
    # simulate's options that need no model: the stages, the batch against the ranks, the tokens' count
    (["simulate", "--cluster", "{tmp}/two-t4.yaml", "--model", "tiny", "--global-batch", "64", "--stages", "5"],
     "--stages"),
    (["simulate", "--cluster", "{tmp}/two-t4.yaml", "--model", "tiny", "--global-batch", "1"],
     "smaller than the 2 ranks"),
    (["simulate", "--cluster", "{tmp}/two-t4.yaml", "--model", "tiny", "--global-batch", str(10**12)],
     "at most 4,194,304"),
    (["simulate", "--cluster", "{tmp}/two-t4.yaml", "--model", "tiny"], "one of them"),
    (["simulate", "--cluster", "{tmp}/two-t4.yaml", "--model", "tiny", "--global-batch", "8",
      "--global-batch-tokens", "2M"], "one of them"),
    (["simulate", "--cluster", "{tmp}/two-t4.yaml", "--model", "tiny", "--global-batch-tokens", "lots"],
     "give a number of tokens"),
    (["profile", "--cluster", "{tmp}/two-t4.yaml", "--model", "llama-13b", "--mixed-precision", "bf16"],
     "mixed precision bf16: t4 (T4-16GB) has no bf16 hardware"),
    (["train", "--cluster", "{tmp}/two-t4.yaml", "--set", "mixed_precision=bf16", "--out", "{tmp}/r"],
     "mixed precision bf16: t4 (T4-16GB) has no bf16 hardware"),
])
def test_refused_before_torch_is_imported(files, args, says):
    run = subprocess.run([sys.executable, "-c", PROBE, *[a.format(tmp=files) for a in args]], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["code"] == 2 and says in out["out"] and not out["torch"], out


def test_the_package_imports_torch_only_when_the_engine_is_asked_for():
    probe = ("import sys, poplar; before = 'torch' in sys.modules; engine = poplar.Engine; "
             "print(before, 'torch' in sys.modules, poplar.engine.initialize.__module__, "
             "poplar.models.tiny.TinyCausalLM.__name__, hasattr(poplar, 'nothing'))")
    run = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.stdout.split() == ["False", "True", "poplar.engine.engine", "TinyCausalLM", "False"], run.stderr
