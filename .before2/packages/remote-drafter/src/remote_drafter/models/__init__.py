"""The drafters: `base` (the interface), `registry` (a spec to a drafter), `ngram`, `lm`
(a small causal LM, e.g. the target's copy), `dspark` (the miniature's Llama-style DSpark),
`dsv41/` (DeepSeek-V4.1's own drafter from its checkpoint or an EXL3 pack), and what they
share: `llama`/`llama_layers`, `window` (rows kept on the device), `cuda_graphs`, `pick`,
`exl3` (EXL3 linears through exllamav3), `exl3_format` (exllamav3's stored format read with numpy),
`exl3_triton` / `exl3_triton_experts` (an EXL3 expert kernel of our own, Triton), `tensors`, `fidelity_gate` (an EXL3 drafter measured
against its dense original). Needs the [worker] extra but for `base`, `registry`, `ngram`."""
