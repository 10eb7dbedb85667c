"""NVIDIA/Megatron-LM#1464: with context parallelism, Transformer Engine's attention backward gave wrong dQ, dK, dV.

The report trained the same GPT on one GPU and with context parallelism (CP), where each rank holds a chunk of the
sequence and Transformer Engine's ``AttnFuncWithCPAndKVP2P`` passes key/value chunks around a ring of ranks,
running TE's fused attention kernels on each pair of chunks. Given the same parameters and data, the attention's
input gradients (dQ, dK, dV) from ``AttnFuncWithCPAndKVP2P.backward()`` differed from one process's by a relative
error up to 1.2, the error flowed into ``linear_qkv`` and every layer before it, and the accumulated ``main_grad``
of the weights differed by up to 2.3 (the same report was filed as NVIDIA/Megatron-LM#1465 and as
NVIDIA/TransformerEngine#1557; all three were closed without a fix named in the thread). The row says why it is not
checked (``not_expressible``); nothing here runs.
"""

from equivcheck.suites.field import Bug

BUG = Bug("NVIDIA/Megatron-LM", "issue", 1464, "tensor",
          "CP on: TE's AttnFuncWithCPAndKVP2P.backward returned wrong dQ/dK/dV (relative error up to 1.2)",
          not_expressible="the faulty code is Transformer Engine's ring-attention backward driving its fused CUDA "
                          "attention kernels (transformer_engine is not installed here and needs CUDA; this task "
                          "has no GPU), and the threads name neither the faulty line nor a fix, so team code written "
                          "here would guess at the bug. The mesh API takes no context-parallel dimension (measured: "
                          "mesh={'cp': 2} is refused, 'among 'dp', 'tp''), and torch's own context_parallel does not "
                          "run on CPU gloo ranks (measured with torch 2.13, 2 ranks, causal SDPA: the default "
                          "kernel raises 'Operator aten._scaled_dot_product_flash_attention_for_cpu.default does not "
                          "have a sharding strategy registered', the math backend 'aten.add.Tensor got mixed "
                          "torch.Tensor and DTensor'). Checking it needs a CUDA device with Transformer Engine and "
                          "a cp dimension in mesh=")
