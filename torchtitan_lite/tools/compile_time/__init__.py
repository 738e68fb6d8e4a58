"""Cold and warm torch.compile time of the transformer blocks, ours against upstream torchtitan's
(``scripts/compile_time_bench.py``). ``protocol`` imports only torch and the standard library: it also runs
inside torchtitan's own environment."""
