"""NVIDIA-NeMo/Automodel#3530: rebuilding the pipeline stages between accumulation steps wiped the gradients.

Automodel re-initialises its ``torch.distributed.pipelining`` stages whenever the sequence length changes, which for
VLM batches is nearly every batch. Stage initialisation ends in ``_post_metadata_inference_cleanup``, which sets
``param.grad = None`` to drop the throw-away gradients of shape inference; with gradient accumulation the rebuild
landed between accumulation steps, so it also dropped the gradients accumulated so far and the optimizer stepped on
the last accumulation step's gradient, where one process steps on the sum over all of them. The fix keeps existing
gradients when the stage uses static metadata (no inference forward or backward ran, so nothing is stale).
"""

from equivcheck.suites.field import Bug

BUG = Bug("NVIDIA-NeMo/Automodel", "pull", 3530, "pipeline",
          "PP stages rebuilt between accumulation steps: param.grad = None wiped the accumulated grads",
          not_expressible=(
              "in the installed torch 2.13, _post_metadata_inference_cleanup sets param.grad = None only on the "
              "parameters of FSDPModule submodules (Automodel's stages are FSDP2-sharded); pipeline=True hands each "
              "rank the whole plain model and an optimizer over its parameters, and fully_shard on a stage would "
              "replace the parameters that optimizer holds. Measured: a step that rebuilds its static-metadata "
              "PipelineStage and GPipe schedule when the sequence length changes (7, then 6 and 7 within one "
              "optimizer step of 2 accumulation steps, tokens case, 2 ranks) keeps the accumulated gradients and is "
              "found equivalent. The API would need pipeline=True with an FSDP2 wrap of each stage (a pipeline by "
              "data-parallel mesh)"))
