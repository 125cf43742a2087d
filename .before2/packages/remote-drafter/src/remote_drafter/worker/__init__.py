"""The drafter worker: `server` (a DraftService behind an ofl server), `service` (requests,
validation, batching), `capacity` (how many requests it holds and for whom: flags shared
with drafter-tp2), `speculation_cache`, `device_lock`, `shadow_parity`, `exl3_admission`
(an EXL3 pack is served only once its fidelity gate passed), and `round_recorder` (gate
rounds recorded from the target's own traffic)."""
