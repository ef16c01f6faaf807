"""Data-parallel training of a torch model with tensorkv.Trainer: each worker computes the
gradients of its own shard with autograd, and trainer.step() pushes them all in one call
(the server averages them and applies SGD) and pulls the new weights into the model.

Needs torch (``.venv/bin/pip install torch``). Run two workers and one server together::

    .venv/bin/tensorkv-launch -n 2 -s 1 .venv/bin/python examples/train_torch.py
"""
import torch

import tensorkv

FEATURES, SAMPLES, STEPS = 8, 256, 100

with tensorkv.create('dist_sync') as kv:
    torch.manual_seed(kv.rank)                     # this worker's shard of the data
    x = torch.randn(SAMPLES, FEATURES)
    y = x @ torch.arange(1.0, FEATURES + 1) + 0.5
    model = torch.nn.Linear(FEATURES, 1)           # rank 0's initial weights win at the first step
    trainer = tensorkv.Trainer(model.named_parameters(), kv,
                               tensorkv.optimizer.SGD(learning_rate=0.1, momentum=0.9))
    for step in range(STEPS):
        model.zero_grad()
        loss = 0.5 * ((model(x)[:, 0] - y) ** 2).mean()
        loss.backward()
        if step == 60:
            trainer.set_learning_rate(0.02)        # keeps the momentum, on every worker
        trainer.step(batch_size=kv.num_workers)    # mean loss on each worker: average the workers' gradients
        if step % 20 == 19:
            print(f"rank {kv.rank} step {step + 1}: loss {loss.item():.6f}")
    print(f"rank {kv.rank} done: weight {[round(w, 3) for w in model.weight[0].tolist()]}, "
          f"bias {model.bias.item():.3f}")
