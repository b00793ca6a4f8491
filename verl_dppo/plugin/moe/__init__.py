"""Mixture-of-experts runs: R3 on verl's FSDP engine (`router_replay`) and which arm of the paper's with/without-R3
comparison a command launches (`arm`)."""
