"""The loss of a traced step: every output matches, the gradient of the loss with respect to the model's output
does not (a micro-batch mean / K, a local mean on ranks).
"""

from __future__ import annotations

from ...diff import Location
from ..hints import factor_of
from ...trace import ModuleCall
from .records import nearly_equal, Records, same_tensors


class Loss(Records):
    """The gradient the loss sent back to the model's output."""

    def _loss(self) -> Location | None:
        theirs = next(filter(None, map(self._joined_call, self._model_output_calls())), None)
        root = self.calls.get("", [None])[0]
        outputs = [] if theirs is None else [self._diff(a, e) for a, e in zip(theirs.outputs, root.outputs)]
        if any(outputs) and all(diff is None or diff.margin <= 1 for diff in outputs):  # those that join match
            pairs = [(self._averaged(actual), self._unscaled(expected))
                     for actual, expected in zip(theirs.grad_outputs, self.calls[""][0].grad_outputs)]
            diffs = [self._diff(actual, expected) for actual, expected in pairs]
            apart = next((diff for diff in diffs if diff is not None and diff.margin > 1), None)
            if apart is not None:
                factors = {None if actual is None or expected is None else factor_of(expected, actual)
                           for actual, expected in pairs if expected is not None}
                factor = factors.pop() if len(factors) == 1 else None
                if factor is not None and not self._read_scaled_by(factor):
                    # a loss scaled by a factor the run divides out of its gradients after backward (a pipeline
                    # schedule's scale_grads): its activation gradients are read without it, as a GradScaler's are
                    self.scale *= factor
                    return None
                return Location(self.step, "loss", "", "the gradient of the loss with respect to the model's "
                                "output", apart.margin, "the model's outputs match")
        loss = next((m for m in self.comparison.mismatches if m.kind == "loss" and m.first_step == self.step), None)
        if loss is not None and not self._grads_differ_here():
            return Location(self.step, "loss", "", "the reported loss", loss.diff.margin, "the model's outputs match")
        return None

    def _read_scaled_by(self, factor: float) -> bool:
        """Whether every gradient the optimizer read whole is the reference's times ``factor``: nothing after backward
        took the factor out."""
        read = [(self.ranks[0].read.get(name), expected) for name, expected in self.reference.read.items()]
        factors = [factor_of(expected, actual) for actual, expected in read
                   if actual is not None and actual.shape == expected.shape and expected.count_nonzero()]
        return all(found is not None and nearly_equal(found, factor, 1e-4) for found in factors)

    def _model_output_calls(self) -> list[ModuleCall]:
        """The reference's calls whose outputs are the model's: the model's own, then any module's that returns them
        (a pipeline's last stage runs its last module, never the whole model)."""
        root = self.calls.get("", [None])[0]
        if root is None:
            return []
        return [root] + [call for call in self.reference.calls if call.module and same_tensors(call.outputs, root.outputs)]

    def _grads_differ_here(self) -> bool:
        return any(m.kind == "grad" and m.first_step == self.step for m in self.comparison.mismatches)
