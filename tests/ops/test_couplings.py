"""The couplings flag of the agreement routings on votes and their dense forms (docs/ops.md): with
couplings=False the operator returns an empty c and the same v and saved state, bit for bit; the
Python functions that return v alone ask for no couplings."""

import pytest
import torch

import capsroute
from op_db import (
    DENSE_CAPSULES,
    DENSE_INVERTED_ATTENTION_ROUTING,
    DENSE_SELF_ATTENTION_ROUTING,
    DYNAMIC_ROUTING,
    INVERTED_ATTENTION_ROUTING,
    SELF_ATTENTION_ROUTING,
)

SPECS = [
    pytest.param(spec, id=spec.name)
    for spec in (
        DYNAMIC_ROUTING,
        DENSE_CAPSULES,
        SELF_ATTENTION_ROUTING,
        INVERTED_ATTENTION_ROUTING,
        DENSE_SELF_ATTENTION_ROUTING,
        DENSE_INVERTED_ATTENTION_ROUTING,
    )
]
POSITIONAL = ("votes", "u", "weight")  # the inputs the Python functions take by position


def public_call(spec, sample):
    """capsroute.<op> (v alone) on the sample: the capsules by position, the rest by name."""
    positional = [t for n, t in zip(spec.input_names, sample.tensors) if n in POSITIONAL]
    named = {n: t for n, t in zip(spec.input_names, sample.tensors) if n not in POSITIONAL}
    return getattr(capsroute, spec.name)(*positional, **named, **sample.options)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_without_couplings_the_same_outputs_and_an_empty_c(spec, device, dtype):
    sample = spec.draw(spec.shapes[torch.float32][0], device, dtype)
    with torch.no_grad():
        v, c, s_hist = spec.op(*spec.schema_args(sample))
        v_alone, empty, s_hist_alone = spec.op(*spec.schema_args(sample), False)
    assert c.shape[-1] > 0
    assert empty.shape == (0,) and empty.dtype == v.dtype and empty.device == v.device
    assert torch.equal(v_alone, v) and torch.equal(s_hist_alone, s_hist)


@pytest.mark.parametrize("spec", SPECS)
def test_opcheck_without_couplings(spec, device):
    """The fake, the autograd formula and the schema agree for couplings=False too."""
    sample = spec.draw(spec.opcheck[0][0], device, torch.float64)
    torch.library.opcheck(spec.op, spec.schema_args(sample), {"couplings": False})


@pytest.mark.parametrize("spec", SPECS)
def test_the_functions_of_v_ask_for_no_couplings(spec, device, monkeypatch):
    """capsroute.<op> calls its operator with couplings=False, and its v and gradients are those of
    the call that returns the couplings."""
    sample = spec.draw(spec.opcheck[0][0], device, torch.float64)
    op = getattr(torch.ops.capsroute, spec.name)
    asked = []

    def spy(*args, **kwargs):
        asked.append(kwargs.get("couplings", True))
        return op(*args, **kwargs)

    module = getattr(capsroute, spec.name).__module__
    monkeypatch.setattr(f"{module}.fused_ops", type("Ops", (), {spec.name: staticmethod(spy)}))
    v = public_call(spec, sample)
    monkeypatch.undo()
    assert asked == [False]
    v_with_c = spec.op(*spec.schema_args(sample))[0]
    assert torch.equal(v, v_with_c)
    inputs = sample.inputs()
    for a, b in zip(
        torch.autograd.grad(v.sum(), inputs), torch.autograd.grad(v_with_c.sum(), inputs)
    ):
        assert torch.equal(a, b)


def test_compiled_dynamic_routing_without_couplings(device):
    """torch.compile(fullgraph=True) traces the call without couplings through its fake."""
    torch._dynamo.reset()
    votes, bias = DYNAMIC_ROUTING.draw((3, 37, 7, 16), device, torch.float32).tensors
    compiled = torch.compile(lambda x, b: capsroute.dynamic_routing(x, bias=b), fullgraph=True)
    assert torch.equal(compiled(votes, bias), capsroute.dynamic_routing(votes, bias=bias))
