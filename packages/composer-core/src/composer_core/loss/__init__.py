"""The composer objective's loss math (torch only).

``compose`` (the 3-channel total), ``policy`` (channel 1: GRPO-family surrogate, KL, rollout correction, DPPO),
``advantages``, ``distill`` (channel 2 kernels: generalized JSD, fused linear, top-k, sampled-token) and its
wrappers (``wrappers``: TAID, entropy-aware OPD), ``preference`` (channel 3: DPO family, SimPO) and ``validation``
(the shared input checks). The public names are re-exported by :mod:`composer_core`.
"""
