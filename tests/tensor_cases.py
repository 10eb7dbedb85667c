"""A case for the tensor-parallel tests that ranks import by name: tp_mlp with no pitfall declared, so that each
tensor-parallel pitfall reads as the mismatch it is."""

import dataclasses

import equivcheck as ec

UNDECLARED = ec.register_case(dataclasses.replace(ec.get_case("tp_mlp"), name="tp_mlp_undeclared", expect_mismatch={}))
