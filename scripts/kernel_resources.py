"""Registers, stack and spills of every CUDA kernel, from the ptxas report of a build.

setup.py compiles the CUDA sources with `--resource-usage`, so ptxas reports each kernel as it is
built; scripts/env.sh keeps the build's output in build/build.log. This prints one row per kernel
and architecture and exits 1 if a kernel spills registers to local memory on an architecture
named by --fail-on (default: every one). CI fails on any spill, on sm_80 and sm_90 alike (the
kernels' launch bounds ask sm_80's ptxas for room where it would otherwise spill).

The functions the kernels call out of line (__noinline__: inlined, they made the kernels spill)
have their own spills, listed after the kernels and not fatal: what the kernels gained by calling
them is the measure there (docs/kernels.md, "Registers").

    python scripts/kernel_resources.py [build/build.log] [--fail-on sm_90 ...]
"""

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

ENTRY = re.compile(r"Compiling entry function '(\S+)' for '(sm_\d+a?)'")
PROPERTIES = re.compile(r"Function properties for (\S+)")
FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
REGISTERS = re.compile(r"Used (\d+) registers")


def parse(log: str) -> tuple[list[dict], list[dict]]:
    """(kernels, called functions): one record per compiled entry function and per function it
    calls out of line, for each architecture, in the order ptxas reports them (deduplicated: a
    called function compiled in several translation units keeps its largest spill)."""
    kernels, called = {}, {}
    current, callee, arch = None, None, None
    for line in log.splitlines():
        if m := ENTRY.search(line):
            current = {"mangled": m.group(1), "arch": m.group(2)}
            arch = current["arch"]
        elif (
            (m := PROPERTIES.search(line))
            and arch
            and not (current and m.group(1) == current["mangled"])
        ):
            callee = {"mangled": m.group(1), "arch": arch}
        elif m := FRAME.search(line):
            frame = dict(
                stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3))
            )
            if callee:
                callee.update(frame)
                key = (callee["mangled"], callee["arch"])
                if key not in called or called[key]["spill_stores"] < callee["spill_stores"]:
                    called[key] = callee
                callee = None
            elif current:
                current.update(frame)
        elif current and (m := REGISTERS.search(line)):
            current["registers"] = int(m.group(1))
            kernels[(current["mangled"], current["arch"])] = current
            current = None
    return list(kernels.values()), list(called.values())


def demangle(names: list[str]) -> list[str]:
    if not names or shutil.which("c++filt") is None:
        return names
    out = subprocess.run(
        ["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True
    ).stdout
    # the kernel's name and template arguments; the parameter list repeats what they imply
    return [re.sub(r"^void ", "", name).split("(")[0] for name in out.splitlines()]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("log", nargs="?", type=Path, default=Path("build/build.log"))
    p.add_argument(
        "--fail-on", nargs="*", metavar="ARCH", help="archs where a spill fails (default: all)"
    )
    args = p.parse_args(argv)
    path = args.log
    kernels, called = parse(path.read_text(errors="replace"))
    if not kernels:
        print(
            f"no ptxas resource report in {path} (built without CUDA, or without --resource-usage?)"
        )
        return 1
    for k, name in zip(kernels + called, demangle([k["mangled"] for k in kernels + called])):
        k["name"] = name
    kernels.sort(key=lambda k: (k["name"], k["arch"]))
    width = max(len(k["name"]) for k in kernels)
    print(f"{'kernel':{width}}  arch    regs  stack  spill st/ld")
    for k in kernels:
        print(
            f"{k['name']:{width}}  {k['arch']:6} {k['registers']:5} {k['stack']:6}  "
            f"{k['spill_stores']}/{k['spill_loads']}"
        )
    spilling = [k for k in kernels if k["spill_stores"] or k["spill_loads"]]
    print(f"{len(kernels)} kernels, {len(spilling)} spilling registers")
    fatal = [k for k in spilling if args.fail_on is None or k["arch"] in args.fail_on]
    for k in spilling:
        print(
            f"{'SPILL' if k in fatal else 'spill (not fatal)'}: {k['name']} ({k['arch']}): "
            f"{k['spill_stores']} bytes stored, {k['spill_loads']} loaded"
        )
    called_spilling = sorted(
        (k for k in called if k["spill_stores"] or k["spill_loads"]),
        key=lambda k: (k["name"], k["arch"]),
    )
    print(
        f"{len(called)} functions called out of line, {len(called_spilling)} spilling (not fatal)"
    )
    for k in called_spilling:
        print(
            f"spill in a called function (not fatal): {k['name']} ({k['arch']}): "
            f"{k['spill_stores']} bytes stored, {k['spill_loads']} loaded"
        )
    return 1 if fatal else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
