"""scripts/gpu_sweep.py runs on a GPU machine whose minutes are scarce: check here, on small shapes,
that it runs, covers every op and records what it claims."""

import json

from helpers import load_script


def test_quick_sweep_on_cpu(tmp_path):
    assert (
        load_script("gpu_sweep").main(["--device", "cpu", "--quick", "--out", str(tmp_path)]) == 0
    )
    report = json.loads((tmp_path / "gpu-sweep.json").read_text())
    ops = {r["case"].split()[0] for r in report["results"]}
    assert ops == {
        "squash",
        "dynamic_routing",
        "dense_capsules",
        "self_attention_routing",
        "inverted_attention_routing",
        "dense_self_attention_routing",
        "dense_inverted_attention_routing",
        "em_routing",
        "em_routing_pose",
        "conv_dynamic_routing",
        "conv_em_routing",
    }
    assert {r["dtype"] for r in report["results"]} == {"float64", "float32"}
    assert all(r["passed"] and r["deterministic"] for r in report["results"])
    assert all(r["kernel_path"] == "cpu/cpu" for r in report["results"])
    # every output and every gradient is compared: dense_capsules has v and 3 gradients
    assert all(
        len(r["rel_errors"]) == 4
        for r in report["results"]
        if r["case"].startswith("dense_capsules")
    )
