"""The GPU catalogue: every GPU the project names is there, and CUDA device names find the right entry."""

import doctest
from pathlib import Path

import pytest
from pydantic import ValidationError

from poplar.cluster import catalogue
from poplar.cluster.catalogue import CATALOGUE, DTYPES, GpuSpec, gpu, match_cuda_name, peak_tflops

REQUIRED = ["A100-80GB", "A100-40GB", "A800-80GB", "V100-16GB", "V100S-32GB", "T4-16GB", "H100-80GB", "H100-PCIe",
            "H100-NVL", "H200", "L4", "L40S", "A10", "RTX-4090", "RTX-3090"]


@pytest.mark.parametrize("name", REQUIRED)
def test_every_required_gpu_has_positive_figures_and_a_source(name):
    spec = CATALOGUE[name]
    assert spec.name == name
    assert spec.memory_gb > 0 and spec.memory_bandwidth_gbs > 0 and spec.link_gbs > 0
    assert spec.peak_tflops["fp32"] > 0 and all(v > 0 for v in spec.peak_tflops.values())
    assert set(spec.peak_tflops) <= set(DTYPES)
    assert "https://" in spec.source and spec.source.strip()
    # a dense tensor-core peak is above the plain fp32 one
    assert all(spec.peak_tflops[d] > spec.peak_tflops["fp32"] for d in ("bf16", "fp16") if d in spec.peak_tflops)


def test_data_sheet_figures():
    a100, h100, h200 = gpu("A100-80GB"), gpu("H100-80GB"), gpu("H200")
    assert a100.peak_tflops == {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}
    assert (a100.memory_bandwidth_gbs, gpu("A100-40GB").memory_bandwidth_gbs, a100.link_gbs) == (2039, 1555, 600)
    assert (h100.peak_tflops["bf16"], h100.peak_tflops["fp32"], h100.memory_bandwidth_gbs, h100.link_gbs) == (
        989.0, 67.0, 3350, 900)
    assert h200.memory_gb == 141 and h200.memory_bandwidth_gbs == 4800
    assert gpu("A800-80GB").link_gbs == 400 and gpu("A800-80GB").peak_tflops == a100.peak_tflops
    assert (gpu("V100-16GB").link_gbs, gpu("V100S-32GB").link_gbs) == (300, 16)   # NVLink; PCIe 3.0
    assert gpu("RTX-4090").peak_tflops["bf16"] == 165.2                          # fp32 accumulate, dense


@pytest.mark.parametrize("name", ["V100-16GB", "V100S-32GB", "T4-16GB"])
def test_no_bf16_or_tf32_before_ampere(name):
    assert "bf16" not in CATALOGUE[name].peak_tflops and "tf32" not in CATALOGUE[name].peak_tflops
    assert peak_tflops(name, "bf16") is None
    assert peak_tflops(name, "fp16") == CATALOGUE[name].peak_tflops["fp16"]


@pytest.mark.parametrize("device_name, entry", [
    ("NVIDIA H100 PCIe", "H100-PCIe"),
    ("NVIDIA H100 80GB HBM3", "H100-80GB"),
    ("NVIDIA H100 NVL", "H100-NVL"),
    ("NVIDIA A100-SXM4-40GB", "A100-40GB"),
    ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
    ("NVIDIA A100 80GB PCIe", "A100-80GB"),
    ("NVIDIA A800-SXM4-80GB", "A800-80GB"),
    ("Tesla V100-SXM2-16GB", "V100-16GB"),
    ("Tesla V100S-PCIE-32GB", "V100S-32GB"),     # V100S is not a V100
    ("Tesla T4", "T4-16GB"),
    ("NVIDIA GeForce RTX 4090", "RTX-4090"),
    ("NVIDIA GeForce RTX 3090", "RTX-3090"),
    ("NVIDIA L4", "L4"),                         # not L40S
    ("NVIDIA L40S", "L40S"),                     # not L4
    ("NVIDIA A10", "A10"),
    ("NVIDIA H200", "H200"),
    ("NVIDIA GH200 480GB", "GH200-96GB"),        # the superchip, its own entry (not an H200)
    ("NVIDIA H100 80GB HBM3 (79.1 GiB, sm_90)", "H100-80GB"),   # a discovered kind's name
])
def test_cuda_names_find_their_entry(device_name, entry):
    assert match_cuda_name(device_name).name == entry
    assert gpu(device_name).name == entry


@pytest.mark.parametrize("device_name", ["NVIDIA A100-SXM4-80GB", "NVIDIA A100-PCIE-40GB", "NVIDIA A100 80GB PCIe"])
def test_an_a100_is_never_an_a10(device_name):
    assert match_cuda_name(device_name).name.startswith("A100")


@pytest.mark.parametrize("device_name", ["Some Future GPU", "NVIDIA A10G", "NVIDIA L40", "", "cpu"])
def test_names_outside_the_catalogue_match_nothing(device_name):
    assert match_cuda_name(device_name) is None
    assert peak_tflops(device_name, "bf16") is None


def test_every_entry_is_found_by_its_own_words_and_no_two_share_them():
    for spec in CATALOGUE.values():
        assert match_cuda_name(" ".join(spec.match)) is spec
    assert len({frozenset(w.lower() for w in spec.match) for spec in CATALOGUE.values()}) == len(CATALOGUE)


def test_gpu_by_key_in_any_case():
    assert gpu("a100-80gb") is CATALOGUE["A100-80GB"]
    assert gpu(" h100-pcie ") is CATALOGUE["H100-PCIe"]
    assert gpu("rtx-4090") is CATALOGUE["RTX-4090"]
    assert gpu("L4") is CATALOGUE["L4"] and gpu("l40s") is CATALOGUE["L40S"]


def test_an_unknown_gpu_is_an_error_that_lists_the_known_ones():
    with pytest.raises(ValueError) as e:
        gpu("B200")
    message = str(e.value)
    assert "'B200'" in message and "\n" not in message
    assert all(name in message for name in CATALOGUE)
    assert "cluster file" in message


def test_peak_tflops_by_key_or_cuda_name():
    assert peak_tflops("A100-80GB", "bf16") == 312.0
    assert peak_tflops("NVIDIA A100-SXM4-40GB", "tf32") == 156.0
    assert peak_tflops("NVIDIA H100 PCIe", "fp32") == 51.0
    assert peak_tflops("NVIDIA L4", "bf16") == 121.0 and peak_tflops("NVIDIA L40S", "bf16") == 362.05
    with pytest.raises(ValueError, match="choose one of fp32, tf32, bf16, fp16"):
        peak_tflops("A100-80GB", "bfloat16")


@pytest.mark.parametrize("change, words", [
    ({"peak_tflops": {"fp32": 1.0, "fp8": 2.0}}, "unknown dtypes ['fp8']"),
    ({"peak_tflops": {"bf16": 2.0}}, "give its fp32 peak"),
    ({"peak_tflops": {"fp32": 1.0, "bf16": 0.0}}, "leave out a dtype the GPU lacks"),
    ({"match": ("A100-SXM4",)}, "not single words"),
    ({"match": ()}, "match"),
    ({"memory_gb": 0}, "memory_gb"),
    ({"source": ""}, "source"),
    ({"speed": 1.0}, "speed"),
])
def test_a_spec_is_validated(change, words):
    good = CATALOGUE["A100-80GB"].model_dump()
    GpuSpec.model_validate(good)
    with pytest.raises(ValidationError, match=words.replace("[", r"\[").replace("]", r"\]")):
        GpuSpec.model_validate({**good, **change})


def test_the_module_examples_run():
    failed, tried = doctest.testmod(catalogue)
    assert tried > 0 and failed == 0


def _catalogue_table() -> dict[str, list[str]]:
    """The rows of the table under "## The GPU catalogue" in docs/devices.md, by entry."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "devices.md").read_text()
    section = text.split("## The GPU catalogue", 1)[1].split("\n## ", 1)[0]
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")]
            for line in section.splitlines() if line.startswith("| ") and not line.startswith("| Entry")]
    return {row[0]: row for row in rows}


def test_the_docs_table_agrees_with_the_catalogue():
    def figure(x: float | None) -> str:
        return "—" if x is None else f"{x:g}"

    table = _catalogue_table()
    assert list(table) == list(CATALOGUE)
    for name, spec in CATALOGUE.items():
        peaks = spec.peak_tflops
        expected = [name, " ".join(spec.match), figure(spec.memory_gb), figure(spec.memory_bandwidth_gbs),
                    *(figure(peaks.get(d)) for d in ("fp32", "tf32", "bf16", "fp16")), figure(spec.link_gbs)]
        assert table[name][:9] == expected, name
        assert "(https://" + spec.source.rsplit(", https://", 1)[1] + ")" in table[name][9], name
