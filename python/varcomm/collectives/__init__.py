"""Collectives over a Communicator: all-to-all (alltoall) and MoE dispatch/combine (moe)."""
