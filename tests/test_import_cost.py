"""What `import equivcheck` must not pay for: FSDP2 (it pulls in DTensor, about half a second: the
`import equivcheck / import torch` row of bench/bench_speed.py) and the terminal extra's rich."""

import subprocess
import sys

HEAVY = ("torch.distributed.tensor", "torch.distributed.fsdp", "torch.distributed.pipelining", "rich")


def test_import_equivcheck_leaves_fsdp2_dtensor_pipelining_and_rich_unimported():
    code = f"import sys, equivcheck; print([m for m in {HEAVY!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
