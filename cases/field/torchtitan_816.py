"""pytorch/torchtitan#816: a checkpoint saved on 4 data-parallel ranks and loaded on 2 dropped half the loader states.

torchtitan checkpoints one dataloader state per data-parallel rank, under the keys ``dataloader.dp_rank_0`` to
``dp_rank_{N-1}``, each rank reading its own shard of the dataset. The pull lists what a change of the data-parallel
degree did: saved on 4 and loaded on 4, right; saved on 2 and loaded on 4, an error (the keys ``dp_rank_2`` and
``dp_rank_3`` are not in the checkpoint, as #811 reported for 8 to 16 GPUs); saved on 4 and loaded on 2, the run
went on silently with the states of ranks 2 and 3 never loaded, their shards' positions lost. Dataloader resharding
was not supported, so the pull's fix stores the data-parallel degree in the loader's state and raises when the
degree it is loaded on differs. The row is not checked (``not_expressible``): the run as fixed is that error, not a
resumed training that could be found equivalent, and no resumed run on 2 ranks continues the 4-rank run's data, as
each rank's shard is cut by the degree (the model and optimizer reshard through DCP: fsdp:world_size=4>resume:at=1>
fsdp:world_size=2 is equivalent in equivcheck's own checkpoint).
"""

from equivcheck.suites.field import Bug

BUG = Bug("pytorch/torchtitan", "pull", 816, "resume",
          "saved on dp=4, loaded on dp=2: dataloader.dp_rank_2/3 silently never loaded, their positions lost",
          not_expressible="the fix makes the changed data-parallel degree an error at load (no resharding of the "
                          "dataloader), so the code as fixed trains nothing to compare, and no resumed 2-rank run can "
                          "continue the 4-rank run's samples: each rank reads a shard cut by the degree. A row needs a "
                          "run as fixed that trains (a dataloader that reshards its position), which torchtitan did "
                          "not have")
