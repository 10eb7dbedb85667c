"""Worker entry point, started by the pool as ``python -m equivcheck.distributed ARGS``.

ARGS: RANK WORLD_SIZE BACKEND STORE FD PARENT_PID THREADS START_TIMEOUT
"""

import sys
from multiprocessing.connection import Connection

from ..process_exit import exit_without_teardown
from .worker import worker_main

rank, world_size, backend, store, fd, parent, threads, start_timeout = sys.argv[1:9]
worker_main(int(rank), int(world_size), backend, store, Connection(int(fd)), int(parent), int(threads),
            float(start_timeout))
exit_without_teardown(0)
