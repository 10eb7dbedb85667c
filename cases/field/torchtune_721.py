"""meta-pytorch/torchtune#721: a compiled model kept its LoRA adapters on inside ``disable_adapter``.

torchtune's ``disable_adapter(model)`` context manager sets ``disabled = True`` on every LoRA layer, whose forward
then skips the adapter's low-rank update: DPO takes its reference model's log-probabilities that way, from the
policy's own weights with the adapters off. The report (written from PEFT's own trouble with compiled LoRA, torch
2.2.2) adds a test that compiles a ``LoRALinear``, calls it, then calls it again inside ``disable_adapter``: compiled,
the disabled output equalled the enabled one, because Dynamo had guarded nothing on the module's plain Python
attribute and reused the graph traced with the adapter on; a compiled DPO run would have taken its reference from the
adapted policy. Torch's issue #124717 (opened from this report) tracked the missing guard. The row is not checked
(``not_expressible``): the installed torch 2.13 recompiles when the flag changes. Measured with a model of two
``LoRALinear`` layers (frozen base weights, rank-2 adapters) trained 3 steps on a DPO-style loss whose reference
logits come from the same model under ``disable_adapter``: compiled with ``aot_eager`` the adapters' gradients equal
eager's exactly, with ``inductor`` within 1.3e-15, and the disabled logits differ from the enabled ones as in eager.
"""

from equivcheck.suites.field import Bug

BUG = Bug("meta-pytorch/torchtune", "issue", 721, "compile",
          "disable_adapter flipped a LoRA layer's flag after compiling: the graph with adapters on was reused",
          fixed_by="in torch (pytorch/pytorch#124717)",
          not_expressible="fixed in the installed torch 2.13: Dynamo now recompiles when the module's disabled flag "
                          "changes (measured: a two-LoRALinear model trained 3 steps on a DPO-style loss whose "
                          "reference logits come from the same model under disable_adapter has the adapters' gradients "
                          "of eager under aot_eager, exactly, and inductor, within 1.3e-15). Checking it needs a torch "
                          "from before the fix (the report's 2.2.2); the team's code is the same before and after it")
