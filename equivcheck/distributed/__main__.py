"""The forker's entry point, started by forker.Forker as ``python -m equivcheck.distributed FD PARENT_PID``."""

import sys

from ..process_exit import exit_without_teardown
from .forker import serve

serve(int(sys.argv[1]), int(sys.argv[2]))
exit_without_teardown(0)
