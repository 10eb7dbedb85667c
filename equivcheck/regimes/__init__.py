"""The regimes, by family: ``base`` (the interface, specs, the registry), ``loop`` (the micro-batch
loop they share), ``local`` (full batch and faithful accumulation), ``pitfalls`` (each bug beside its
faithful twin), ``ddp`` (DistributedDataParallel and DataParallel), ``ddp_hooks`` (DDP with a compressing comm
hook, judged at its own error bound), ``ddp_join`` (uneven inputs under DDP, with and without join),
``ddp_partial`` (seed 000's accumulation over part of the model inside DDP and DataParallel), ``fsdp`` (FSDP2
fully_shard), ``zero`` (ZeroRedundancyOptimizer), ``pipeline`` (torch.distributed.pipelining stages),
``tensor`` (tensor parallelism: parallelize_module on a mesh), ``packing`` (documents packed into rows, against them padded), ``experts`` (expert parallelism, and aux terms normalised wrong across ranks), ``pipeline_mesh`` (pipeline x FSDP2 x
tensor parallelism on a three-dimensional mesh), ``checkpoint`` (activation checkpointing inside
accumulation), ``sync_batchnorm`` (SyncBatchNorm under DDP, GPUs
only), ``user_code`` (a team's own step or loop). A regime of your own is one module that calls
:func:`register_regime` on its class.
"""

from . import (checkpoint, context, ddp, ddp_hooks, experts, pipeline_mesh, ddp_join, ddp_partial, fsdp, local, packing, pipeline, pitfalls, sequence,
               resume, sync_batchnorm, tensor, user_code, zero)
from .base import (DEFAULT_REGIMES, REGIMES, Chunked, CommunicationCounter, Pitfall, Regime, chunk_pairs, finish_step,
                   parse_regime, regime_source, register_regime, spec_usage)
from .loop import accumulate, backward_chunks, global_mean_part, inputs_only, meddling_part

# Every built-in regime, registered here and only here; a name registered twice is an error.
BUILT_IN: tuple[type[Regime], ...] = (
    local.FullBatch, local.SampleBySample, local.Accumulate, local.RetainedGraph, local.DetachedPartial,
    local.SummedLoss,
    pitfalls.NaiveAccumulate, pitfalls.TermsPerMicroBatch, pitfalls.AccumulateDividedTwice, pitfalls.ZeroGradInside,
    pitfalls.StepPerMicroBatch, pitfalls.ClipPerMicroBatch,
    pitfalls.ScalerAccumulate, pitfalls.ScalerUnscalePerMicroBatch, pitfalls.ScalerStepPerMicroBatch,
    pitfalls.ReplayedDropout, pitfalls.PerToken, pitfalls.SamplerPad, pitfalls.SamplerDrop,
    ddp.Ddp, ddp.DdpNoSync, ddp.DdpNoSyncFindUnused, ddp.DdpNoSyncStaticGraph, ddp.DdpSyncEveryMicroBatch,
    ddp.DdpMeanLoss, ddp.DdpPaddedSampler, ddp.DataParallel,
    ddp_hooks.DdpHook, ddp_hooks.DdpHookMeanLoss,
    ddp_join.DdpJoin, ddp_join.DdpUnevenWithoutJoin, ddp_join.DdpJoinRankMean, ddp_join.DdpUnevenMicroBatches,
    ddp_join.DdpUnevenMicroBatchesJoin,
    ddp_partial.DdpDetachedPartial, ddp_partial.DdpDetachedPartialLastOutside, ddp_partial.DdpDetachedPartialBypass,
    ddp_partial.DdpDetachedPartialInForward, ddp_partial.DdpDetachedPartialSyncEveryChunk,
    ddp_partial.DataParallelDetachedPartial,
    fsdp.Fsdp, fsdp.FsdpMeanLoss, fsdp.FsdpClipAveraged, fsdp.FsdpNoSync, fsdp.FsdpSyncEveryMicroBatch,
    fsdp.Hsdp, fsdp.HsdpClipOverReplicas, context.ContextParallel,
    tensor.TensorParallel, tensor.TensorParallelDifferentBatches, tensor.TensorParallelLossScaled,
    tensor.TensorParallelClipLocal, tensor.TensorParallelDropoutRankSeeded, tensor.FsdpTensorParallel, tensor.FsdpTensorParallelWorldScaled,
    sequence.TensorSequenceParallel, sequence.TensorSequenceParallelNormUnreduced, sequence.FsdpTensorSequenceParallel,
    zero.Zero,
    pipeline.Pipeline, pipeline.PipelineMeanLoss, pipeline.PipelineScaledTwice,
    checkpoint.Checkpoint, checkpoint.CheckpointReentrant, checkpoint.CheckpointWithoutRngState,
    sync_batchnorm.SyncBatchNorm,
    user_code.DdpStep,
    user_code.DdpLoop,
    user_code.PipelineStep,
    user_code.PipelineLoop,
    user_code.MeshStep,
    user_code.MeshLoop,
    resume.Resume, resume.ResumeWithoutOptimizer, resume.ResumeWithoutRng, resume.ResumeFromTheStart,
    resume.ResumeOptimizerOfRankZero, resume.ResumeWithoutScaler, resume.ResumeWithoutScheduler,
    pipeline_mesh.PipelineFsdpTensorParallel, pipeline_mesh.PipelineFsdpTensorParallelScaledTwice,
    pipeline_mesh.PipelineFsdpTensorParallelRanksDiffer,
    experts.ExpertParallel, experts.ExpertParallelAveraged, experts.FsdpExpertParallel, experts.FsdpExpertParallelOverReplicas,
    experts.ExpertParallelClipLocal, experts.FsdpExpertParallelClipLocal, pipeline.PipelineClipTiedPerStage, experts.DdpAuxOverWorld, experts.DdpAuxTimesWorld,
    packing.Packed, packing.PackedPositionsRunOn, packing.PackedLabelAcross, packing.PackedRowMean,
)
for _regime in BUILT_IN:
    register_regime(_regime)

# The classes by name, for code that subclasses or checks them.
from .ddp import Distributed  # noqa: E402
from .local import Accumulate, DetachedPartial, FullBatch, RetainedGraph, SampleBySample, SummedLoss  # noqa: E402
from .user_code import UserLoop, UserStep  # noqa: E402

__all__ = [
    "BUILT_IN", "DEFAULT_REGIMES", "REGIMES", "Accumulate", "Chunked", "CommunicationCounter", "DetachedPartial",
    "Distributed", "FullBatch", "Pitfall", "Regime", "RetainedGraph", "SampleBySample", "SummedLoss", "accumulate",
    "backward_chunks", "chunk_pairs", "finish_step", "global_mean_part", "inputs_only", "meddling_part", "parse_regime",
    "regime_source", "register_regime", "spec_usage", "UserLoop", "UserStep",
]
