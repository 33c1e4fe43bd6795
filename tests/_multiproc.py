"""Helpers for tests that start several gloo ranks on this machine."""
import socket

import torch


def free_port() -> int:
    """A localhost TCP port nobody listens on right now (for MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_method() -> str:
    # fork skips re-importing torch in the children (seconds each); it is unsafe once CUDA is initialized
    return "spawn" if torch.cuda.is_initialized() else "fork"
