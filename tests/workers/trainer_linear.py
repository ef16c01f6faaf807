"""One worker of a dist_sync run training a linear model y = x @ weight.T + bias with
tensorkv.Trainer (SGD with momentum on the servers, the learning rate lowered before step
argv[4]). argv[1]: 'torch' (an nn.Linear, gradients from autograd), 'numpy' (arrays,
gradients written out) or 'numpy-gluon' (the same, the Trainer made in gluon's order with
update_on_kvstore=False: the servers sum, each worker runs SGD); argv[2]: an .npz with this rank's data x<rank>, y<rank> and initial
values weight<rank>, bias<rank>; argv[3]: the number of steps. Prints the final
{"weight": ..., "bias": ...}."""
import json
import sys

import numpy as np

import tensorkv

LEARNING_RATE, MOMENTUM, LOWER_RATE = 0.1, 0.9, 0.05

framework, data_file, steps, lower_at = sys.argv[1], np.load(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])


def numpy_training(kv, x, y, weight, bias):
    params = {"weight": weight.copy(), "bias": bias.copy()}
    if framework == "numpy-gluon":
        trainer = tensorkv.Trainer(params, "sgd", {"learning_rate": LEARNING_RATE, "momentum": MOMENTUM}, kv,
                                   update_on_kvstore=False)
    else:
        trainer = tensorkv.Trainer(params, kv, tensorkv.optimizer.SGD(learning_rate=LEARNING_RATE, momentum=MOMENTUM))
    for step in range(1, steps + 1):
        error = x @ params["weight"][0] + params["bias"][0] - y  # of the loss 0.5 * mean(error ** 2)
        grads = {"weight": (error @ x / len(y))[None, :], "bias": np.array([error.mean()], np.float32)}
        if step == lower_at:
            trainer.set_learning_rate(LOWER_RATE)
        trainer.step(kv.num_workers, grads=grads)
    return params


def torch_training(kv, x, y, weight, bias):
    import torch

    model = torch.nn.Linear(x.shape[1], 1)
    with torch.no_grad():
        model.weight.copy_(torch.from_numpy(weight))
        model.bias.copy_(torch.from_numpy(bias))
    trainer = tensorkv.Trainer(model.named_parameters(), kv,
                               tensorkv.optimizer.SGD(learning_rate=LEARNING_RATE, momentum=MOMENTUM))
    x, y = torch.from_numpy(x), torch.from_numpy(y)
    for step in range(1, steps + 1):
        model.zero_grad()
        loss = 0.5 * ((model(x)[:, 0] - y) ** 2).mean()
        loss.backward()
        if step == lower_at:
            trainer.set_learning_rate(LOWER_RATE)
        trainer.step(kv.num_workers)
    return {name: param.detach().numpy() for name, param in model.named_parameters()}


with tensorkv.create("dist_sync") as kv:
    data = [data_file[f"{name}{kv.rank}"] for name in ("x", "y", "weight", "bias")]
    params = (torch_training if framework == "torch" else numpy_training)(kv, *data)
    print(json.dumps({name: value.tolist() for name, value in params.items()}))
