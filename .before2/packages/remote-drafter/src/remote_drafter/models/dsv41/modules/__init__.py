"""DeepSeek's drafter as modules that own their weights, each built from the checkpoint's
names under its prefix, so a faster implementation replaces one module and nothing else:

* numerics.py   how every module computes (dtype, the wider dtype of reductions, eps) and
                the round's kernels or torch for norms, RoPE and the top two
* module.py     the base: a module's own tensors and the modules under it; where weights
                come from (dense tensors, or linears another back end such as EXL3 serves)
* inputs.py     the taps' projection (context side) and the block's embedding
* mix.py        the hyper-connection mix (mHC) around one sublayer; V4's learned output collapse
* attention.py  sliding-window attention over the context rows and the block
* moe.py        the router, the routed experts (per matrix; stacked, every expert or grouped
                GEMMs; EXL3 fused) and the shared expert
* heads.py      the head, the Markov head, the confidence head

Dense and EXL3 weights meet at one interface: a linear is a callable x -> x @ W.T, whichever
back end holds W (module.Dense, exl3.Exl3Linear)."""
