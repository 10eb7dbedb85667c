"""deepspeedai/DeepSpeed#2686: ZeRO's step unscaled the gradient norm with the loss scale it had just updated.

With fp16 dynamic loss scaling, ZeRO-1/2's ``step()`` first calls ``_update_scale``, which doubles the scale after
``scale_window`` steps without overflow, and then divided the scaled global gradient norm by ``self.loss_scale``,
the new value. The gradients came from ``backward()`` on the loss times the old scale, so on every step that raised
the scale the norm DeepSpeed reported was half the true one; one process unscales with the scale its backward used
and only then updates it. The fix (pull #2695) keeps the scale from before the update and divides the norm by it.
"""

from equivcheck.suites.field import Bug

BUG = Bug("deepspeedai/DeepSpeed", "issue", 2686, "zero",
          "ZeRO step divided the scaled grad norm by the loss scale just updated, not the one backward used",
          fixed_by="pull #2695",
          not_expressible=(
              "the fix changed only the gradient norm ZeRO reports (get_global_grad_norm): the gradients the "
              "optimizer steps on were unscaled and clipped by unscale_and_clip_grads the same way before and after "
              "it, so the weights of the code as reported and as fixed are the same; equivcheck compares gradients, "
              "weights and the step's loss, and would need a way to compare a logged scalar such as the gradient "
              "norm with the reference's"))
