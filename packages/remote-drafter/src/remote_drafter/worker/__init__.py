"""The drafter worker: `server` (a DraftService behind an ofl server), `service` (requests,
capacity, validation, batching), `speculation_cache`, `device_lock`, `shadow_parity`,
`exl3_admission` (an EXL3 pack is served only once its fidelity gate passed), and
`round_recorder` (gate rounds recorded from the target's own traffic)."""
