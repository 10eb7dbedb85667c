"""KempnerInstitute/KempnerForge#57: the StatefulDataLoader lost its place on the second resume within an epoch.

KempnerForge's ``StatefulDataLoader`` reset ``_batches_yielded`` to 0 on every ``__iter__``, its ``load_state_dict``
read ``batches_yielded`` into a local variable and never wrote it back, and the sampler's ``set_skip`` was used up by
the first ``iter()``. The report's sequence: run 1 yields 30 batches and saves ``batches_yielded=30``; run 2 skips 30
batches, restarts its counter at 0, yields 10 more and saves ``batches_yielded=10``, not 40; run 3 skips only 10, so
every resume after the first within an epoch shifted the data order silently. The fix (pull #58) stores the loaded
count on the loader, re-applies the skip on every ``iter()`` and keeps the counter monotonic within the epoch. The
row is not checked (``not_expressible``): the first resume is right, and the fault needs a run saved again after it
has been resumed, three segments where equivcheck's resume joins two.
"""

from equivcheck.suites.field import Bug

BUG = Bug("KempnerInstitute/KempnerForge", "issue", 57, "resume",
          "StatefulDataLoader's batch count restarted at 0 after a resume: the second resume skipped too few",
          fixed_by="pull #58",
          not_expressible="the fault shows only from a second resume within an epoch (the first restores the "
                          "position right): it needs a run saved, restored, saved again and restored again, three "
                          "segments, and a resume (BEFORE>resume:at=K>AFTER, check_step's resume=Checkpoint(at=K)) "
                          "joins two. The API would need several saves in one run (Checkpoint(at=(K1, K2)))")
