"""The native kernels' gate: every stage of the native round against the staged float64
reference (staged_round.py), on fresh random drafters and inputs and on real drafter states
of the trained checkpoint, with comparison.py's comparison (relative error per stage against a
stated tolerance; non-finite, missing or unstated fails). Before each run every output
buffer is poisoned (NaN, token -1), so an unwritten element fails as non-finite. The
greedy draft tokens must all equal the reference's; a difference is reported with the
reference's top-2 logit gap there (ARCHITECTURE.md § Exactness).

Inputs never hold zeros as data: hidden rows are Gaussian, padding positions of the
context window hold random rows too (they must be masked out, not be harmless), positions
start far from zero (RoPE at large angles).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from remote_drafter.models.dspark import DSparkConfig, DSparkModel, init_weights

from .comparison import Check, GateReport, compare, merge
from .native import NativeRound, with_width
from .staged_round import RoundInputs, as_dtype, stage_names, staged_round, top2_gap

# Relative error per stage, float32 kernels vs the float64 reference. Float32 arithmetic
# lands near 1e-7..1e-6 per stage (what each stage gave, under the interpreter and on the
# GPU: findings/native-drafter.md); a wrong index, mask, norm or RoPE lands at 1e-2 and
# above. Far under 1e-3, as float32 must be (METHOD.md).
TOLERANCES = {
    "ctx": 2e-5,             # one projection (K = 3 x 576)
    "L": 5e-5,               # every sublayer of every layer (errors grow through layers)
    "head.logits": 5e-5,
    "markov.logits": 5e-5,
}
TOKENS = "draft.tokens"


@dataclass
class Case:
    name: str
    model: DSparkModel       # float32, on the device the kernels run on
    inputs: RoundInputs      # on the CPU


def random_inputs(c: DSparkConfig, batch: int, generator: torch.Generator) -> RoundInputs:
    n = c.window
    valid = torch.zeros(batch, n, dtype=torch.bool)
    for b in range(batch):  # right-aligned as DSparkDrafter._context lays them; request 0 full
        valid[b, n - (n if b == 0 else int(torch.randint(1, n + 1, (1,), generator=generator))):] = True
    start = torch.randint(1, 200_000, (batch, 1), generator=generator)
    pos = start + torch.arange(n)
    return RoundInputs(torch.randn(batch, n, c.feature or c.hidden_size, generator=generator),
                       valid, pos, torch.randint(0, c.vocab_size, (batch,), generator=generator),
                       pos[:, -1] + 1)


def random_case(c: DSparkConfig, batch: int, width: int, seed: int, device) -> Case:
    """A fresh drafter (weights, embedding, head all random) and fresh inputs."""
    g = torch.Generator().manual_seed(seed)
    embed = torch.randn(c.vocab_size, c.hidden_size, generator=g)
    head = torch.randn(c.vocab_size, c.hidden_size, generator=g) * 0.2
    model = init_weights(DSparkModel(c, embed, head), seed=seed, std=0.05).to(device).eval()
    return Case(f"random-b{batch}-w{width}", with_width(model, width), random_inputs(c, batch, g))


def run_case(case: Case, device, native_cls=NativeRound, tolerances=TOLERANCES) -> GateReport:
    """One case: reference (float64, CPU) vs the native round on `device`, stage by stage
    (`native_cls`: the round under test; the tests pass broken ones)."""
    x = case.inputs
    ref = staged_round(as_dtype(case.model, torch.float64).cpu(),
                       RoundInputs(x.ctx.double() if x.ctx.is_floating_point() else x.ctx,
                                   x.ctx_valid, x.ctx_pos, x.anchor, x.anchor_pos))
    native = native_cls(case.model)
    ws = native.workspace(case.inputs.batch, case.model.config.block_size, probs=True)
    ws.load(case.inputs.to(device))
    ws.poison()
    native.run(ws)
    got = {k: v.cpu() for k, v in native.stages(ws).items()}
    tokens = got.pop(TOKENS)
    report = compare({k: v for k, v in ref.items() if k != TOKENS}, got, tolerances, label=f"{case.name}/")
    report.checks.append(token_check(f"{case.name}/{TOKENS}", tokens, ref[TOKENS], ref["markov.logits"],
                                     case.model.config.vocab_size))
    return report


def token_check(name: str, got: torch.Tensor, ref: torch.Tensor, ref_logits: torch.Tensor,
                vocab: int) -> Check:
    """Fraction of draft tokens that differ from the reference's (tolerance 0)."""
    if got.shape != ref.shape:
        return Check(name, float("inf"), 0.0, f"shape {tuple(got.shape)} != {tuple(ref.shape)}")
    unwritten = int(((got < 0) | (got >= vocab)).sum())
    if unwritten:
        return Check(name, float("inf"), 0.0, f"{unwritten} tokens unwritten or out of range")
    differ = got != ref
    if not differ.any():
        return Check(name, 0.0, 0.0)
    b, i = (int(x) for x in differ.nonzero()[0])
    gap = top2_gap(ref_logits[b, i])
    return Check(name, float(differ.float().mean()), 0.0,
                 f"{int(differ.sum())} of {differ.numel()} differ; first at request {b} position {i}, "
                 f"where the reference's top-2 logit gap is {float(gap):.3g}")


def run_gate(cases: list[Case], device) -> GateReport:
    return merge([run_case(c, device) for c in cases])


def stage_table(report: GateReport, num_layers: int) -> str:
    """One line per stage: its worst case against its tolerance."""
    lines = [f"{'stage':<16} {'worst case':<22} {'rel. error':>11} {'tolerance':>10}  result"]
    for stage in stage_names(num_layers):
        mine = [c for c in report.checks if c.name.split("/", 1)[1] == stage]
        if not mine:
            lines.append(f"{stage:<16} {'-':<22} {'-':>11} {'-':>10}  FAIL not checked")
            continue
        worst = max(mine, key=lambda c: (not c.passed, c.error / c.tolerance if c.tolerance else c.error))
        lines.append(f"{stage:<16} {worst.name.split('/', 1)[0]:<22} {worst.error:>11.3e} "
                     f"{worst.tolerance:>10.1e}  {'ok' if worst.passed else 'FAIL ' + worst.why}")
    lines.append(f"{len(report.checks)} checks over {len({c.name.split('/', 1)[0] for c in report.checks})} "
                 f"cases: {'PASS' if report.passed else 'FAIL'}")
    return "\n".join(lines)


def real_case(model: DSparkModel, requests, name: str = "trained") -> Case:
    """Real drafter states (DraftRequests of target text, states.py) through the trained
    drafter, laid out as the worker lays them out."""
    from remote_drafter.models.dspark import DSparkDrafter

    from .staged_round import inputs_from_requests
    layout = DSparkDrafter(model.config, model, None, "cpu")
    return Case(f"{name}-b{len(requests)}-w{model.config.block_size}", model,
                inputs_from_requests(layout, requests))
