"""huggingface/peft#2826: activated LoRA's offsets never reached checkpoint recompute; its adapters got no gradient.

Activated LoRA (aLoRA) adapts a sequence only from its invocation tokens on: ``PeftModel.forward`` finds where the
last invocation sequence starts (``alora_offsets``, counted back from the end) and, inside
``_enable_peft_forward_hooks``, registers a forward pre-hook on every LoRA layer that hands the offsets to
``ALoraLinearVariant.forward``, removing the hooks when the forward returns. Gradient checkpointing recomputes each
decoder layer's forward during backward, long after that context has closed: the recompute ran with
``alora_offsets=None``, which the variant reads as "adapter nowhere", so the recomputed graph held the base alone and
every adapter in a checkpointed layer got a zero gradient, silently (the report's DPO run; transformers' default
reentrant checkpointing, the input embeddings made to require a gradient by
``prepare_model_for_gradient_checkpointing``). The fix (pull #2860) also registers a pre-hook on each
gradient-checkpointing layer that re-registers the offset hooks on its LoRA layers whenever the layer runs, recompute
included, and a full backward hook that removes them. The row trains a frozen-embedding LM whose block and output
layer are aLoRA layers, each sequence given the invocation token at a random real position, the block checkpointed
reentrant.
"""

import contextlib
import dataclasses
from functools import partial

import torch
from torch.utils.checkpoint import checkpoint

import equivcheck as ec
from equivcheck.suites.field import Bug
from equivcheck_cases.adapters import HIDDEN, LoRALinear
from equivcheck_cases.field._adapters import FrozenEmbeddingLM, frozen_embedding, stepped, token_mean_loss
from equivcheck_cases.tokens import DIM, PAD, VOCAB

BUG = Bug("huggingface/peft", "issue", 2826, "adapters",
          "aLoRA offsets passed by forward hooks were gone at checkpoint recompute: its adapters got 0 grad",
          fixed_by="pull #2860", fix_acts="backward block")

ALORA_INVOCATION_TOKENS = (5,)


class ALoRALinear(LoRALinear):
    """``ALoraLinearVariant.forward``: the adapter added only on each row's last ``alora_offsets[i]`` positions;
    ``alora_offsets=None`` (no offsets handed over) means the base alone."""

    def forward(self, inputs, alora_offsets=None):
        batch, length = inputs.shape[:2]
        if alora_offsets is None:  # use base model only, but ensure 0 gradient
            mask = torch.zeros(batch, length, dtype=torch.bool)
        else:
            offsets = torch.tensor([0 if o is None else min(int(o), length) for o in alora_offsets])
            mask = torch.arange(length)[None] >= (length - offsets)[:, None]
        adapter = self.scale * (inputs @ self.lora_a.T) @ self.lora_b.T
        return self.base(inputs) + mask[..., None] * adapter


class ActivatedLM(FrozenEmbeddingLM):
    """FrozenEmbeddingLM with aLoRA layers; its forward is ``PeftModel.forward``'s: the offsets from the tokens,
    handed to every aLoRA layer by forward hooks."""

    def __init__(self) -> None:
        super().__init__()
        self.block = torch.nn.Sequential(ALoRALinear(DIM, HIDDEN), torch.nn.Tanh(), ALoRALinear(HIDDEN, DIM))
        self.head = ALoRALinear(DIM, VOCAB)

    def forward(self, tokens):
        with enable_peft_forward_hooks(self, calculate_alora_offsets(tokens)):
            return super().forward(tokens)


def calculate_alora_offsets(tokens):
    """Per row, where the last invocation sequence starts, counted back from the end (None: it holds none)."""
    length, size = tokens.shape[1], len(ALORA_INVOCATION_TOKENS)
    invocation = torch.tensor(ALORA_INVOCATION_TOKENS)
    offsets = []
    for row in tokens:
        starts = [i for i in range(length - size + 1) if torch.equal(row[i:i + size], invocation)]
        offsets.append(length - starts[-1] if starts else None)
    return offsets


def _alora_offsets_pre_forward_hook(target, args, kwargs, alora_offsets):
    kwargs["alora_offsets"] = alora_offsets
    return args, kwargs


@contextlib.contextmanager
def enable_peft_forward_hooks(model, alora_offsets, gradient_checkpointing_layers=(), hooks_for_recompute=True):
    """``LoraModel._enable_peft_forward_hooks``: the offsets' pre-hook on every aLoRA layer for this forward; with the
    fix, on each gradient-checkpointing layer a pre-hook that registers them again on its aLoRA layers whenever it
    runs (its recompute in backward too) and a full backward hook that removes them."""
    hook_handles = []
    for layer in model.modules():
        if hooks_for_recompute and layer in gradient_checkpointing_layers:

            def forward_pre_hook(module, inputs):
                for submodule in module.modules():
                    if isinstance(submodule, ALoRALinear):
                        handle = submodule.register_forward_pre_hook(
                            partial(_alora_offsets_pre_forward_hook, alora_offsets=alora_offsets), with_kwargs=True)
                        module._peft_gradient_checkpointing_forward_hooks.append(handle)

            def backward_hook(module, *grad_output):
                while module._peft_gradient_checkpointing_forward_hooks:
                    module._peft_gradient_checkpointing_forward_hooks.pop().remove()

            layer._peft_gradient_checkpointing_forward_hooks = [layer.register_forward_pre_hook(forward_pre_hook),
                                                                layer.register_full_backward_hook(backward_hook)]
        if isinstance(layer, ALoRALinear):
            hook_handles.append(layer.register_forward_pre_hook(
                partial(_alora_offsets_pre_forward_hook, alora_offsets=alora_offsets), with_kwargs=True))
    try:
        yield
    finally:
        for handle in hook_handles:
            handle.remove()


def data():
    """The tokens case's padded sequences, each with the invocation token at a random place among its real tokens
    (the adapter is active from there on)."""
    tokens, targets = frozen_embedding.data()
    lengths = (tokens != PAD).sum(1)
    starts = (torch.rand(len(tokens)) * lengths).long()
    tokens[torch.arange(len(tokens)), starts] = ALORA_INVOCATION_TOKENS[0]
    return tokens, targets


activated = ec.register_case(dataclasses.replace(
    frozen_embedding, name="field_alora_frozen_embedding", model=ActivatedLM, data=data,
    description="activated LoRA on the block and the output layer of an LM whose embedding is frozen, each sequence "
                "adapted from its invocation token on"))


def train_step(model, optimizer, batch, hooks_for_recompute=True):
    """The training forward with gradient checkpointing on: the block recomputed reentrant in backward, its input
    made to require a gradient (``enable_input_require_grads``)."""
    tokens, targets = batch
    with enable_peft_forward_hooks(model, calculate_alora_offsets(tokens), (model.block,), hooks_for_recompute):
        hidden = model.embed(tokens).requires_grad_(True)
        logits = model.head(hidden + checkpoint(model.block, hidden, use_reentrant=True))
    return stepped(optimizer, token_mean_loss(logits, targets))


def train_step_as_reported(model, optimizer, batch):
    return train_step(model, optimizer, batch, hooks_for_recompute=False)


def buggy():
    return ec.check_step(activated, train_step_as_reported)


def fixed():
    return ec.check_step(activated, train_step)
