"""dist_sync with torch: init 'w', then pull it into a torch tensor and into a Parameter that
requires grad; prints both as JSON (stderr must stay free of torch's warnings)."""
import json

import numpy as np
import torch

import tensorkv

with tensorkv.create("dist_sync") as kv:
    kv.init("w", np.arange(4, dtype=np.float32))
    tensor, parameter = torch.zeros(4), torch.nn.Parameter(torch.zeros(4))
    kv.pull("w", out=tensor)
    kv.pull("w", out=parameter)
    print(json.dumps([tensor.tolist(), parameter.tolist(), parameter.requires_grad]))
