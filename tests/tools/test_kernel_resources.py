"""scripts/kernel_resources.py reads ptxas' report of a build: CI fails on a kernel's spill, and
lists, without failing, those of the functions the kernels call out of line."""

from helpers import load_script

# ptxas' report as a build prints it: a kernel, then a function it calls, compiled again in a
# second translation unit with a larger spill.
LOG = """\
ptxas info    : Compiling entry function '_Z6kernelPf' for 'sm_90'
ptxas info    : Function properties for _Z6kernelPf
    8 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 64 registers, used 1 barriers, 8 bytes cumulative stack size
ptxas info    : Compile time = 1.0 ms
ptxas info    : Function properties for _Z6calleePd
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Compiling entry function '_Z6kernelPf' for 'sm_90'
ptxas info    : Function properties for _Z6kernelPf
    8 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 64 registers, used 1 barriers, 8 bytes cumulative stack size
ptxas info    : Function properties for _Z6calleePd
    0 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads
"""
SPILLING_KERNEL = """\
ptxas info    : Compiling entry function '_Z5otherv' for 'sm_80'
ptxas info    : Function properties for _Z5otherv
    16 bytes stack frame, 12 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 128 registers, used 0 barriers
"""


def test_kernels_and_the_functions_they_call_apart(tmp_path, capsys):
    module = load_script("kernel_resources")
    kernels, called = module.parse(LOG)
    assert [(k["mangled"], k["registers"], k["spill_stores"]) for k in kernels] == [
        ("_Z6kernelPf", 64, 0)
    ]
    assert [(k["mangled"], k["arch"], k["spill_stores"]) for k in called] == [
        ("_Z6calleePd", "sm_90", 8)
    ]
    log = tmp_path / "build.log"
    log.write_text(LOG)
    assert module.main([str(log)]) == 0  # a called function's spill is listed, not fatal
    assert "spill in a called function (not fatal)" in capsys.readouterr().out
    log.write_text(LOG + SPILLING_KERNEL)
    assert module.main([str(log)]) == 1
    assert module.main([str(log), "--fail-on", "sm_90"]) == 0
