"""DeepSeek-V4.1's own DSpark drafter (the `mtp.*` tensors of its checkpoint), computed as
vLLM 0.33.0 computes it: `config` (the config keys and the checkpoint's tensor table,
torch-free), `model` (the forward in plain torch), and the checkpoint side (`quant`,
`checkpoint`, `tiny`)."""
