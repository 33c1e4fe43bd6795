"""LayerFns: the functions a ModelRunner calls for each layer's torch pieces, eager or torch.compile'd.

The engine runs models/layers.py's functions around its own attention core (runner.py); this module says which
versions of them: the plain functions (EAGER), their torch.compile'd twins (compiled_fns), with the Triton decode
attention and sampler wherever Triton runs (default_fns). Kept apart from runner.py so that the bitwise mode's
functions (rollout/bitwise.py) can build a LayerFns without importing the runner that chooses them.
Not here: the choice between these and the bitwise ones (runner.layer_fns), the kernels (kernels.py, torch_path.py).
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from phaserl.compile_cache import specialize_floats
from phaserl.models.layers import post_attention, pre_attention, rms_norm
from phaserl.rollout import kernels, sample_kernel
from phaserl.rollout.sampling import keyed_noise
from phaserl.rollout.torch_path import cached_attention, sample_tokens


class LayerFns(NamedTuple):
    pre: callable       # layers.pre_attention
    post: callable      # layers.post_attention
    norm: callable      # layers.rms_norm
    attend: callable    # (q, k, v, keys, values, pos, scale, window) -> [b, Hq * D], writes k/v into the cache
    sample: callable    # sample_tokens (every setting; needs noise)
    fast_sample: Optional[callable]  # sample_kernel.sample (no top-k/top-p): one pass, in-kernel keyed noise
    noise: callable = keyed_noise  # (seed, keys, at, V) -> Exp(1) [b, V] for `sample`; on CUDA sample_kernel's
    prefill: callable = F.scaled_dot_product_attention  # the prefill pass's attention (SDPA's signature)


EAGER = LayerFns(pre_attention, post_attention, rms_norm, cached_attention, sample_tokens, None)


ENGINE_RECOMPILE_LIMIT = 64


def compile_layer_fn(fn):
    """torch.compile for an engine layer function: dynamic shapes (one compile serves every bucket and the
    prefill), fullgraph. Dynamo still compiles once per distinct layer spec, dtype and set of present weights
    (a bias or none, a qk-norm kind, Gemma's local and global layers), and counts those entries per code
    object for the whole process: 8 by default, then fullgraph=True turns the ninth into an error. A process
    that builds engines for several models (tests, a run with several families) passes 8 quickly (seen on the
    H200 on 2026-12-01: 12 GPU tests failed with "recompile limit exceeded"), so the limit is raised once."""
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, ENGINE_RECOMPILE_LIMIT)
    specialize_floats()  # the norms' eps constants: no restarted compiles (compile_cache.py)
    return torch.compile(fn, dynamic=True, fullgraph=True)


@functools.cache
def compiled_fns() -> LayerFns:
    """torch.compile'd twins of the layer functions (compile_layer_fn). cached_attention writes into the
    cache, so it stays eager (default_fns swaps in the Triton kernel where it runs)."""
    c = compile_layer_fn
    return LayerFns(c(pre_attention), c(post_attention), c(rms_norm), cached_attention, c(sample_tokens), None)


def default_fns(device: torch.device, compile: bool) -> LayerFns:
    """Compiled or eager, with the Triton kernels wherever they run."""
    fns = compiled_fns() if compile else EAGER
    if kernels.available(device):
        fns = fns._replace(attend=kernels.decode_attention, fast_sample=sample_kernel.sample,
                           noise=sample_kernel.keyed_noise)
    return fns
