"""scripts/cuda_check.sh plans the calls of a GPU session, whose minutes are scarce: check here,
without a GPU, that every planned call's stage budgets fit the device tool's call (CALL_SECONDS =
570), that a plan that does not fit is refused, that the header's plan is the one the script runs,
and that an unknown stage fails before anything runs."""

import os
import re
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "cuda_check.sh"


def dry_run(*args, **env):
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        env={**os.environ, "DRY_RUN": "1", **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def planned_calls() -> list[tuple[str, list[tuple[str, int]], int]]:
    """(call, [(stage, budget)], total) for every call of the plan, CALL_SECONDS = 570."""
    done = dry_run(CALL_SECONDS="570")
    assert done.returncode == 0, done.stdout + done.stderr
    calls = []
    for line in done.stdout.splitlines():
        found = re.fullmatch(r"(call-\d+): (.*) = (\d+) s of 570: fits", line)
        assert found, line
        stages = [
            (name, int(seconds)) for name, seconds in re.findall(r"([\w:,-]+) (\d+)", found[2])
        ]
        calls.append((found[1], stages, int(found[3])))
    return calls


def test_every_planned_call_fits_the_device_tools_call():
    calls = planned_calls()
    assert [name for name, _, _ in calls] == [f"call-{n}" for n in range(1, len(calls) + 1)]
    for name, stages, total in calls:
        assert sum(seconds for _, seconds in stages) == total <= 570, name
    # The first call builds, runs the doctor and the minimal timings first; the later ones start
    # from the carried build.
    assert [stage for stage, _ in calls[0][1]][:3] == ["build", "doctor", "bench-minimal"]
    assert all(stages[0][0] == "setup" for _, stages, _ in calls[1:])
    order = [stage.split(":")[0] for _, stages, _ in calls for stage, _ in stages]
    sanitizers = [order.index(tool) for tool in ("memcheck", "racecheck", "initcheck", "synccheck")]
    assert sanitizers[0] == min(sanitizers), "memcheck runs before the other sanitizers"
    # racecheck, in parts, covers every section of the sanitizer workload
    sections = [
        section
        for _, stages, _ in calls
        for stage, _ in stages
        if stage.startswith("racecheck:")
        for section in stage.split(":")[1].split(",")
    ]
    assert sorted(sections) == sorted(["routing", "em", "conv", "attention"])


def test_the_headers_plan_is_the_one_the_script_runs():
    header = re.findall(r"^#   (call-\d+)  ([\w:, -]+?)\s{2,}", SCRIPT.read_text(), re.MULTILINE)
    planned = [
        (name, " ".join(stage for stage, _ in stages if stage != "setup"))
        for name, stages, _ in planned_calls()
    ]
    assert [(name, stages.strip()) for name, stages in header] == planned


def test_a_call_that_does_not_fit_is_refused():
    done = dry_run("call-2", CALL_SECONDS="300")
    assert done.returncode == 1
    assert "does not fit" in done.stdout


def test_stages_given_are_planned_as_one_call():
    done = dry_run("initcheck", "synccheck", "sweep")
    assert done.returncode == 0
    assert re.search(r"initcheck \d+ \+ synccheck \d+ \+ sweep \d+", done.stdout)
    done = dry_run("sanitize")  # two calls' worth (racecheck alone takes most of one)
    assert done.returncode == 1
    assert re.search(
        r"memcheck \d+ \+ racecheck \d+ \+ initcheck \d+ \+ synccheck \d+", done.stdout
    )
    assert dry_run("bench", "bench-em", "bench-models").returncode == 1


def test_an_unknown_stage_fails_before_anything_runs():
    done = dry_run("tests", "bogus")
    assert done.returncode == 2
    assert "unknown stage bogus" in done.stderr
    assert dry_run("call-99").returncode == 2
    for stage in ("racecheck:conv,bogus", "racecheck:", "racecheck:conv,"):
        done = dry_run(stage)
        assert done.returncode == 2
        assert f"unknown stage {stage}" in done.stderr
