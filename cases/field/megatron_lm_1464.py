"""NVIDIA/Megatron-LM#1464: with context parallelism, Transformer Engine's attention backward gave wrong dQ, dK, dV.

The report trained the same GPT on one GPU and with context parallelism (CP), where each rank holds a chunk of the
sequence and Transformer Engine's ``AttnFuncWithCPAndKVP2P`` passes key/value chunks around a ring of ranks,
running TE's fused attention kernels on each pair of chunks. It reports that, given the same parameters and data,
the attention's input gradients (dQ, dK, dV) from ``AttnFuncWithCPAndKVP2P.backward()`` differed from one process's
by a relative error up to 1.2, that the error flowed into ``linear_qkv`` and every layer before it, and that the
accumulated ``main_grad`` of the weights differed by up to 2.3. The same report was filed as NVIDIA/Megatron-LM#1465
and as NVIDIA/TransformerEngine#1557; all three were closed with the fault unconfirmed, no faulty line named and no
fix. The row says why it is not checked (``not_expressible``); nothing here runs.
"""

from equivcheck.suites.field import Bug

BUG = Bug("NVIDIA/Megatron-LM", "issue", 1464, "tensor",
          "reported, closed unconfirmed: with CP, TE's AttnFuncWithCPAndKVP2P.backward gave wrong dQ/dK/dV",
          not_expressible="the faulty code, as reported, is Transformer Engine's ring-attention backward driving its "
                          "fused CUDA attention kernels: transformer_engine needs CUDA and is not installed on the "
                          "machines this table is made on. The report and its two copies were closed with the fault "
                          "unconfirmed and neither a faulty line nor a fix named, so team code written here would "
                          "guess at the bug. mesh={'cp': C} runs a team's own context-parallel split on gloo ranks, "
                          "but a ring attention written for it here would be this project's, not TE's, and torch's "
                          "own context_parallel does not run on CPU gloo ranks (re-measured by the cp regime's "
                          "probe, torch 2.13, causal SDPA in float64 and float32: the default kernel raises 'Operator "
                          "aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding "
                          "strategy registered', the math backend 'aten.add.Tensor got mixed torch.Tensor and "
                          "DTensor'). Checking it needs CUDA GPUs with Transformer Engine: check_step with "
                          "mesh={'cp': 2} and device='cuda', its parallelize handing TE's attention the cp group")
