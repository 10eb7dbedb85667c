"""pytorch/torchtitan#1136: with a vocabulary not divisible by the world size, a resumed run's loss went its own way.

The report trained with a tokenizer whose vocabulary size does not divide by the parallel degree (torch 2.6), saved at
step 10, resumed from it and saw steps 11 on differ from the uninterrupted run's loss. torchtitan's ``ModelWrapper``
builds the model's state dict once (``get_model_state_dict``, kept as ``cache_state_dict``) and hands DCP that cached
dict to save and to load into; on FSDP2 the vocabulary-sized parameters are then sharded unevenly. Pull #1702 is a
temporary fix: it stops using ``cache_state_dict``, after which the resumed loss matched exactly, its author noting
the cause was not yet understood ("why this only happens to uneven sharding"). The row is not checked
(``not_expressible``): the installed torch 2.13 does not reproduce it. Measured with a team step on FSDP2 (each layer
and the root sharded, gloo ranks) whose save and load go through a model state dict cached when training starts, as
torchtitan's did, resumed in fresh processes after one global batch: mlp on 2 ranks (its 3-row head split 2 + 1) and
on 3 ranks (its 10-row layer split 4 + 4 + 2) is equivalent to full batch, and the cached dict's local shards stay the
live parameters' storage through training.
"""

from equivcheck.suites.field import Bug

BUG = Bug("pytorch/torchtitan", "issue", 1136, "resume",
          "resume with FSDP2 shards uneven (vocab % world size != 0): loss after resume diverged",
          fixed_by="pull #1702 (temporary: no cache_state_dict)",
          not_expressible="the installed torch 2.13 does not reproduce it: a team step on FSDP2 whose DCP save and "
                          "load use a model state dict cached at the start of training, as torchtitan's ModelWrapper "
                          "did, resumes equivalent to full batch with uneven shards (mlp on 2 and on 3 gloo ranks, "
                          "resumed after one global batch; measured), and its cached shards alias the live "
                          "parameters. The thread names no faulty line, and its fix is a workaround; checking it needs "
                          "the torch of the report (2.6)")
