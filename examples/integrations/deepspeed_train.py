"""A DeepSpeed training script moved to Poplar by a change of import.

    torchrun --standalone --nproc-per-node 2 examples/integrations/deepspeed_train.py

``ds_config.json`` beside it is a DeepSpeed ZeRO config; its ``poplar`` section names the
emulated cluster (the ``both-differ`` preset: an A800-80GB beside a V100S-32GB, so two
ranks) and the model preset the ranks profile to plan each one's micro-batches. Fields
that tune DeepSpeed's own machinery are named in one line and ignored.
"""

from pathlib import Path

import torch
from torch.utils.data import TensorDataset

import poplar as deepspeed          # was: import deepspeed
from poplar.models.workload import Workload

CONFIG = Path(__file__).with_name("ds_config.json")


def main() -> None:
    torch.set_num_threads(1)
    workload = Workload(model="tiny")                     # the model the config's poplar.models.workload names
    model = workload.build(seed=0)
    data = TensorDataset(*workload.random_batch(32 * 8))  # 8 global batches of 32 samples
    engine, optimizer, loader, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                        training_data=data, config=str(CONFIG))
    for inputs, targets in loader:                      # this rank's micro-batches, its plan's sizes
        loss = workload.loss(engine, (inputs, targets))  # the forward runs through the engine
        engine.backward(loss)
        engine.step()                                   # the update after this rank's last micro-batch
    if engine.global_rank == 0:
        print(f"{engine.runtime.plan}: {engine.global_steps} steps, last loss {engine.last_loss:.3f}, rank 0 ran "
              f"{engine.gradient_accumulation_steps()} micro-batch(es) of {engine.train_micro_batch_size_per_gpu()}")
    engine.close()


if __name__ == "__main__":
    main()
