"""How long a Checkpointer held the training loop per step (its ``stalled`` time: in
``save()`` and waiting for a copy), for benchmarks/integrations_bench.py."""


class SaveCost:
    def __init__(self) -> None:
        self.last = 0.0
        self.per_step: list[float] = []

    def step(self, ckpt) -> None:
        """After a step's save: the stall since the previous one."""
        if ckpt is not None:
            self.per_step.append(ckpt.stalled - self.last)
            self.last = ckpt.stalled

    def report(self, rank: int) -> None:
        if rank == 0 and self.per_step:
            ordered = sorted(self.per_step[1:] or self.per_step)  # the first save sets up
            print(f"median_save_ms={1e3 * ordered[len(ordered) // 2]:.3f}", flush=True)
