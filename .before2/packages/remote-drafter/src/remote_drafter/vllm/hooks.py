"""The runner hooks register() installs (a `vllm.general_plugins` entry point, loaded in
every vLLM process, idempotent): GPUModelRunner's propose_draft_token_ids learns the batch's
request ids, finished requests and committed hidden rows; take_draft_token_ids lets an
asynchronous round hand placeholders; _update_states writes deferred drafts into the next
step's inputs; the EAGLE-3 aux-output setup turns on the drafter's taps. The CPU runner
inherits all four."""

from __future__ import annotations

import logging

import numpy as np

from remote_drafter.engine.rows import as_rows

from .proposer import RemoteProposer

log = logging.getLogger("remote_drafter.vllm")
# vLLM's auxiliary hidden state L is the stream entering layer L. DeepSeek-V4.1's drafter
# names its taps that way, so its ids are used as given; the other drafters here name "the
# output of layer i", which enters layer i + 1 (vLLM 0.33's rule for DSpark:
# v1/worker/gpu/spec_decode/eagle/eagle3_utils.py, get_eagle3_aux_layers_from_config).
TAPS_AS_GIVEN = frozenset({"deepseek_v41"})


def aux_layer_ids(layers: tuple, model_type: str) -> tuple[int, ...]:
    """The vLLM auxiliary hidden-state ids that carry the drafter's taps `layers` on a target
    of `model_type`, sorted as vLLM returns them."""
    shift = 0 if model_type in TAPS_AS_GIVEN else 1
    return tuple(sorted({layer + shift for layer in layers}))


def committed_rows(scheduler_output, req_ids: list[str], sampled, aux: list, layers: tuple,
                   keep: int) -> dict[str, np.ndarray]:
    """{request id: hidden rows [m, len(layers) x H]} of the newest <= `keep` inputs each
    request committed this step. Only those rows leave the device: the worker keeps a
    window of rows, so a long prefill chunk's earlier rows would be copied for nothing.
    `aux`: vLLM's auxiliary hidden states, one [tokens, H] tensor per layer of sorted(layers)
    (aux_layer_ids keeps the order, so the tensor of a tap is found by its rank)."""
    import torch

    spans, start = {}, 0
    for i, rid in enumerate(req_ids):
        n = int(scheduler_output.num_scheduled_tokens.get(rid, 0))
        spec = len(scheduler_output.scheduled_spec_decode_tokens.get(rid, ()))
        accepted = max(len(sampled[i]) - 1, 0) if i < len(sampled) else 0
        committed = n - spec + accepted
        spans[rid] = (start + max(committed - keep, 0), start + committed)
        start += n
    index = np.concatenate([np.arange(a, b) for a, b in spans.values()] or [np.zeros(0, int)])
    order = sorted(set(layers))
    picked = torch.as_tensor(index, dtype=torch.long, device=aux[0].device)
    rows = as_rows(torch.cat([aux[order.index(layer)][picked] for layer in layers], -1))
    out, at = {}, 0
    for rid, (a, b) in spans.items():
        out[rid], at = rows[at:at + b - a], at + b - a
    return out


def register() -> None:
    """vllm.general_plugins entry point: idempotent in every vLLM process."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner as Runner
    if getattr(Runner.propose_draft_token_ids, "_remote_drafter", False):
        return
    propose = propose_hook(Runner.propose_draft_token_ids)
    take = take_hook(Runner.take_draft_token_ids)
    update = update_states_hook(Runner._update_states)
    setup = aux_setup_hook(Runner._setup_eagle3_aux_hidden_state_outputs)
    propose._remote_drafter = True
    Runner.propose_draft_token_ids, Runner.take_draft_token_ids = propose, take
    Runner._update_states, Runner._setup_eagle3_aux_hidden_state_outputs = update, setup


def propose_hook(original):
    """The proposer learns the batch's request ids, finished requests and committed rows."""
    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, sampling_metadata,
                                hidden_states, sample_hidden_states, aux_hidden_states,
                                *args, **kwargs):
        drafter = getattr(self, "drafter", None)
        if isinstance(drafter, RemoteProposer):
            req_ids, rows = list(self.input_batch.req_ids), None
            if drafter.sends_rows and aux_hidden_states:
                rows = committed_rows(scheduler_output, req_ids, sampled_token_ids,
                                      aux_hidden_states, drafter.hidden_layers, drafter.window)
            drafter.set_batch(req_ids, scheduler_output.finished_req_ids, rows)
        return original(self, scheduler_output, sampled_token_ids, sampling_metadata,
                        hidden_states, sample_hidden_states, aux_hidden_states, *args, **kwargs)
    return propose_draft_token_ids


def aux_setup_hook(original):
    def setup_aux_hidden_state_outputs(self):
        """Both runners call this at the end of load_model (for EAGLE-3): turn on the
        outputs at the drafter's taps, in vLLM's ids for this target (aux_layer_ids)."""
        drafter = getattr(self, "drafter", None)
        if not isinstance(drafter, RemoteProposer) or not drafter.hidden_layers:
            return original(self)
        model = self.get_model()
        if not hasattr(model, "set_aux_hidden_state_layers"):
            log.error("the target model cannot output hidden states: the drafter gets none")
            drafter.hidden_layers = ()
            return None
        model_type = getattr(self.model_config.hf_config, "model_type", "")
        model.set_aux_hidden_state_layers(aux_layer_ids(drafter.hidden_layers, model_type))
        self.use_aux_hidden_state_outputs = True
        return None
    return setup_aux_hidden_state_outputs


def take_hook(original):
    """An asynchronous round hands placeholders (or its drafts) when vLLM takes them."""
    def take_draft_token_ids(self):
        drafter = getattr(self, "drafter", None)
        if isinstance(drafter, RemoteProposer):
            structured = any(getattr(self.requests[rid].sampling_params, "structured_outputs", None)
                             for rid in self.input_batch.req_ids)
            rows = drafter.take_rows(structured)
            if rows is not None:
                self._draft_token_ids = rows
        return original(self)
    # inspect.getsource follows __wrapped__: versions' digest check reads vLLM's own code
    take_draft_token_ids.__wrapped__ = original
    return take_draft_token_ids


def update_states_hook(original):
    """A deferred round's drafts are written into the next step's inputs."""
    def _update_states(self, scheduler_output):
        out = original(self, scheduler_output)
        drafter = getattr(self, "drafter", None)
        if isinstance(drafter, RemoteProposer):
            # not caught: a failed broadcast or write would leave TP ranks with other inputs
            drafter.fill(self.input_batch, scheduler_output.scheduled_spec_decode_tokens)
        return out
    _update_states.__wrapped__ = original  # as in take_hook
    return _update_states
