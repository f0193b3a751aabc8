"""A training step captured in one CUDA graph and replayed (`capsroute train --cuda-graph`): a
capsule network's step issues a kernel at a time from Python, fast enough on a GPU for the launches
to be the step's time (docs/training.md); replayed from a graph, the step is one launch."""

from collections.abc import Callable

import torch


class GraphedStep:
    """Runs `step(*args)` (forward, loss, backward and `optimizer.step()`) eagerly until
    `warmup_steps` consecutive calls have had the same shapes, then captures it in a CUDA graph
    and replays that for every call with those shapes; a call with other shapes (an epoch's
    shorter last batch) runs eagerly. Tensor arguments are copied into the graph's own inputs and
    float arguments (a loss margin that changes every step) become device scalars, so both may
    change between replays; so may each parameter group's learning rate, which the captured
    `optimizer.step()` reads from a device scalar. `optimizer` must be capturable, and nothing
    else may change between replays: the graph is what the step did on the capturing call. The
    graph keeps the memory of a step for itself; eager work allocates beside it."""

    def __init__(self, step: Callable, optimizer: torch.optim.Optimizer, warmup_steps: int = 3):
        if not all(group.get("capturable") for group in optimizer.param_groups):
            raise ValueError("GraphedStep: the optimizer must be made with capturable=True")
        self.step, self.optimizer, self.warmup_steps = step, optimizer, warmup_steps
        self.graph: torch.cuda.CUDAGraph | None = None
        self.signature = None  # the shapes, dtypes and float positions of the calls counted below
        self.repeats = 0  # consecutive calls with that signature
        self.inputs: list[torch.Tensor] = []
        self.lrs: list[torch.Tensor] = []
        self.outputs = None

    @staticmethod
    def _signature(args) -> tuple:
        return tuple((a.shape, a.dtype) if isinstance(a, torch.Tensor) else float for a in args)

    def __call__(self, *args):
        signature = self._signature(args)
        if self.graph is not None:
            if signature != self.signature:
                return self.step(*args)
            self._load(args)
            self.graph.replay()
            return self.outputs
        self.repeats = self.repeats + 1 if signature == self.signature else 1
        self.signature = signature
        if self.repeats <= self.warmup_steps:
            # On a side stream, as capture requires of the calls before it (the backward pass's
            # streams and the optimizer's state are set up there).
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                outputs = self.step(*args)
            torch.cuda.current_stream().wait_stream(side)
            return outputs
        self._capture(args)
        self.graph.replay()  # capturing ran nothing
        return self.outputs

    def _capture(self, args) -> None:
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        self.inputs = [
            a.clone()
            if isinstance(a, torch.Tensor)
            else torch.tensor(float(a), dtype=torch.float32, device=device)
            for a in args
        ]
        groups = self.optimizer.param_groups
        # float32 on the parameters' device: what the captured step reads at every replay
        self.lrs = [
            torch.tensor(float(group["lr"]), dtype=torch.float32, device=group["params"][0].device)
            for group in groups
        ]
        scheduled = [group["lr"] for group in groups]  # the floats the scheduler keeps there
        for group, lr in zip(groups, self.lrs):
            group["lr"] = lr
        # The captured backward pass writes the gradients into the graph's memory, not into
        # whatever an eager step left.
        self.optimizer.zero_grad(set_to_none=True)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                self.outputs = self.step(*self.inputs)
        finally:
            for group, lr in zip(groups, scheduled):
                group["lr"] = lr
        self.graph = graph

    def _load(self, args) -> None:
        for static, a in zip(self.inputs, args):
            if isinstance(a, torch.Tensor):
                static.copy_(a, non_blocking=True)
            else:
                static.fill_(a)
        for lr, group in zip(self.lrs, self.optimizer.param_groups):
            lr.fill_(group["lr"])
