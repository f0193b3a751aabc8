"""The processes of a `capsroute train` run: one, or one per GPU under torchrun."""

import dataclasses
import os

import torch
import torch.distributed as dist


@dataclasses.dataclass
class Distributed:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls, device_kind: str) -> "Distributed":
        """Under torchrun (WORLD_SIZE > 1) joins the process group: NCCL on GPUs, gloo on CPUs."""
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if world_size == 1:
            return cls()
        dist.init_process_group("nccl" if device_kind == "cuda" else "gloo")
        return cls(dist.get_rank(), world_size, int(os.environ.get("LOCAL_RANK", "0")))

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def sum(self, values: list[float], device: torch.device) -> list[float]:
        if self.world_size == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=device)
        dist.all_reduce(t)
        return t.tolist()
