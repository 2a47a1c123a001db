"""The simulator at scale: the simulated profile of 4,096 GPUs of six kinds, this tree's simulator beside an earlier
commit's, each in a fresh process, side by side in one run (the same machine, the same load).

The earlier simulator is this tree with ``poplar/simulate`` and ``poplar/devices/simulated.py`` as they were at
``--before`` (a copy in a temporary folder, first on the path): the rest of the package is the same for both, so
the two profiles must be equal, and the table says whether they are. Times are the simulation's own (the profile
from a loaded cluster), wall and CPU, the best of ``--repeat``; imports apart.

    python bench/bench_simulate_scale.py --before 8aed9b7
    python bench/bench_simulate_scale.py --models llama-7b --clusters bench/clusters/six-kinds-4096-counts.yaml
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SIMULATOR = ("poplar/simulate", "poplar/devices/simulated.py")
CLUSTERS = ("bench/clusters/six-kinds-4096-per-node.yaml", "bench/clusters/six-kinds-4096-counts.yaml")

# run in a fresh process: the profile written to argv[5], the seconds to stdout
_ONE = """
import json, sys, time
t0 = time.perf_counter()
from poplar.cluster.spec import load_cluster
from poplar.models.workload import model_source
from poplar.profile.options import ProfileOptions
from poplar.simulate import simulate_profile
imported = time.perf_counter() - t0
model, cluster, seq_len, precision, out = sys.argv[1:6]
spec, wl = load_cluster(cluster), model_source(model, seq_len=int(seq_len))
options = ProfileOptions(stages=[0, 1, 2, 3], precision=precision)
wall, cpu = time.perf_counter(), time.process_time()
profile = simulate_profile(wl, spec, options)
wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
open(out, "w").write(profile.model_dump_json())
print(json.dumps({"wall": wall, "cpu": cpu, "imports": imported}))
"""


def earlier_tree(rev: str, into: Path) -> Path:
    """This tree's ``poplar`` package with the simulator's files as at ``rev``, under ``into``."""
    shutil.copytree(ROOT / "poplar", into / "poplar", ignore=shutil.ignore_patterns("__pycache__"))
    for path in SIMULATOR:
        target = into / path
        if target.is_dir():
            shutil.rmtree(target)
        listed = subprocess.run(["git", "ls-tree", "-r", "--name-only", rev, path], cwd=ROOT, check=True,
                                capture_output=True, text=True).stdout.split()
        for name in listed:
            text = subprocess.run(["git", "show", f"{rev}:{name}"], cwd=ROOT, check=True, capture_output=True).stdout
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            (into / name).write_bytes(text)
    return into


def simulate_once(path: Path | None, model: str, cluster: str, seq_len: int, precision: str, out: Path) -> dict:
    env = dict(os.environ)
    if path is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(path), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", _ONE, model, cluster, str(seq_len), precision, str(out)],
                          cwd=path or ROOT, env=env, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", default=None, help="the commit whose simulator to time beside this tree's")
    p.add_argument("--models", default="llama-7b,llama-70b")
    p.add_argument("--clusters", default=",".join(CLUSTERS))
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--precision", default="fp16")
    p.add_argument("--repeat", type=int, default=2, help="runs of each, the best kept")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        trees = {"now": None}
        if args.before:
            trees = {args.before[:9]: earlier_tree(args.before, tmp / "before"), **trees}
        print(f"{'model':<10} {'cluster':<34} {'simulator':<10} {'wall s':>7} {'cpu s':>7}  same profile")
        for model in args.models.split(","):
            for cluster in args.clusters.split(","):
                profiles = {}
                for name, path in trees.items():
                    out = tmp / f"{name}.json"
                    runs = [simulate_once(path, model, str(ROOT / cluster), args.seq_len, args.precision, out)
                            for _ in range(args.repeat)]
                    profiles[name] = json.loads(out.read_text())
                    same = "" if len(profiles) < 2 else ("yes" if len({json.dumps(v, sort_keys=True)
                                                                       for v in profiles.values()}) == 1 else "NO")
                    print(f"{model:<10} {Path(cluster).name:<34} {name:<10} {min(r['wall'] for r in runs):>7.2f} "
                          f"{min(r['cpu'] for r in runs):>7.2f}  {same}", flush=True)


if __name__ == "__main__":
    main()
