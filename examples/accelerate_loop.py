"""A training loop with Hugging Face accelerate and gemini's in-memory checkpoints.

What ``Accelerator.save_state`` would save (models, optimizers, schedulers, registered
objects, the accelerator's step) goes into gemini's memory at every step; needs
``accelerate`` (``pip install -e '.[frameworks]'``).

    gemini run --nproc-per-node 2 --max-restarts 3 examples/accelerate_loop.py --steps 60

Kill a worker mid-run (``pkill -9 -f accelerate_loop.py -n``): the loop resumes at the
next step, the data loader fast-forwarded with ``skip_first_batches``.
"""

import argparse

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed

from launcher import Checkpointer
from launcher.integrations.accelerate import accelerator_state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    # The seedable sampler draws each epoch's order from the seed and the epoch alone, so a
    # resumed run replays it in every epoch (docs/integrations.md, "The data order").
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(
        use_seedable_sampler=True))
    set_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    g = torch.Generator().manual_seed(0)
    inputs = torch.randn(512, 16, generator=g)
    dataset = torch.utils.data.TensorDataset(inputs, inputs.sum(dim=1, keepdim=True))
    data = torch.utils.data.DataLoader(dataset, batch_size=16, shuffle=True)
    model, optimizer, data, scheduler = accelerator.prepare(model, optimizer, data, scheduler)

    ckpt = Checkpointer(extra={"accelerator": accelerator_state(accelerator)})
    step = ckpt.restore()  # 0, or the step to resume at
    while step < args.steps:
        epoch, skip = divmod(step, len(data))
        data.set_epoch(epoch)
        for x, y in accelerator.skip_first_batches(data, skip) if skip else data:
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            ckpt.save(step)
            if accelerator.is_main_process and step % 10 == 0:
                print(f"step {step} loss {loss.item():.4f}", flush=True)
            step += 1
            if step == args.steps:
                break
    ckpt.close()
    accelerator.end_training()


if __name__ == "__main__":
    main()
