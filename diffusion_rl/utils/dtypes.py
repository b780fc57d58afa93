"""The dtype names configs use (model.dtype, model.autocast, sampling.latents_dtype) and the torch dtypes they mean."""

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
