"""Kernels that fault, for tests: the bf16 probe of a machine whose default oneDNN kernels kill their process with
SIGILL unless a rule's way out is taken.

A probe runs either in a fork of the test's process (it calls this process's ``kernels.probe_kernels``) or, where that
process may not fork one (a machine with a GPU), in a fresh interpreter that runs ``kernels.PROBE_COMMAND``: both are
replaced, so the same faulting machine is seen whichever way the probe goes.
"""

from __future__ import annotations

import os
import signal

import torch

from equivcheck.process import kernels

RULES = {  # what a probe must have to survive
    "isa_capped": lambda: "ONEDNN_MAX_CPU_ISA" in os.environ,  # oneDNN's ISA capped below AMX
    "mkldnn_off": lambda: not torch._C._get_mkldnn_enabled(),  # oneDNN off altogether
    "never": lambda: False,  # no path survives
}


def install(rule: str, setattr=setattr) -> None:
    """Make this process's probes, forked or fresh, die of SIGILL unless ``rule`` holds (``setattr``: a test's
    ``monkeypatch.setattr``, which puts both back after it)."""
    def probe_kernels(precision) -> None:
        if not RULES[rule]():
            os.kill(os.getpid(), signal.SIGILL)

    setattr(kernels, "probe_kernels", probe_kernels)
    setattr(kernels, "PROBE_COMMAND", f"{kernels.WITHOUT_WORKING_DIRECTORY}import faulty_kernels; "
                                      f"faulty_kernels.install({rule!r}); from equivcheck.process.kernels import "
                                      "probe_main; probe_main()")
