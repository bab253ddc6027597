"""Test-wide environment, set at import time before anything imports the Triton kernels."""

import os

import torch

if not torch.cuda.is_available():
    # Triton's jit reads this when a kernel module is imported: run kernels on the CPU interpreter.
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
