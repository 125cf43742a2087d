"""GPU tier: DeepSeek-V4's drafter here against exllamav3 1.6.5's own (run by benchmarks/gpu.sh
with ONLY_EXL3=1 on an H200; exllamav3 and its missing dependencies come as carried wheels).

exllamav3 runs its own DeepSeek-V4 trunk and DSpark drafter on a tiny random V4 checkpoint
(dsv41/tiny.py, variant v4, a whole unquantised trunk, a byte-level BPE tokenizer trained here
on the repository's own Markdown); hooks on its drafter record, for every draft pass, the taps
its trunk exported (each layer's stream mean, fp16, as `update_kv_from_target` receives them,
by position), the seed, its position p0 and the drafts. The same taps, seed and p0 go to this
project's Dsv41Drafter (kind dsv41, V4 mode, float32, loaded from the checkpoint's `mtp.*`),
and the drafts are compared: whole chains, and position by position with our Markov bias
taken from exllamav3's previous draft (so one disagreement does not hide the rest); every
disagreement is set against the probability gap behind it (ours and exllamav3's top-2).

Three times: on the unconverted checkpoint (exllamav3 loads bf16 tensors as fp16 linears); on
its own conversion (`conversion.convert_model -b BITS --mtp_bits 16 --head_bits 16`: the
trunk's layers quantised to EXL3, the drafter and the shared head left unquantised, so the
taps are those of exllamav3's quantised trunk and the drafters should still agree); and on
its conversion with the drafter quantised too (`--mtp_bits BITS --head_bits 6`), which this
project's drafter loads from exllamav3's own output folder (models/dsv41/exl3_pack.load:
the same EXL3 tensors, run through exllamav3's quantised linear): both sides then draft with
identical quantised weights.
EXL3_DSPARK_CONF=0: every round's drafts are verified (none cut by confidence).

Prints a table last and writes JSON (--out)."""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

from remote_drafter.models.base import DraftRequest
from remote_drafter.models.dsv41 import tiny
from remote_drafter.models.dsv41.drafter import Dsv41Drafter

ROOT = Path(__file__).resolve().parents[3]
VOCAB = 2048
# Real V4 head geometry (512-wide heads, 64 rope dims, one KV row) at toy width, every size a
# multiple of 128 so EXL3 can quantise the trunk; sliding-window layers only, no hash layers.
SIZES = {"vocab_size": VOCAB, "hidden_size": 512, "num_hidden_layers": 4,
         "num_attention_heads": 8, "head_dim": 512, "qk_rope_head_dim": 64,
         "q_lora_rank": 256, "o_groups": 2, "o_lora_rank": 256,
         "n_routed_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 256,
         "dspark_target_layer_ids": [1, 2, 3], "dspark_markov_rank": 64,
         "dspark_noise_token_id": VOCAB - 1, "bos_token_id": 0, "eos_token_id": 1}
PROMPT_TOKENS = (12, 60, 200, 400)  # two longer than the 128-row window


# -- the checkpoint and its tokenizer --------------------------------------------------------

def corpus() -> list[str]:
    """The repository's own Markdown, paragraph by paragraph (deterministic, no download)."""
    text = []
    for path in sorted(ROOT.glob("**/*.md")):
        if ".venv" in path.parts or ".artifacts" in path.parts:
            continue
        text += [p for p in path.read_text(errors="replace").split("\n\n") if len(p) > 40]
    return text


def write_tokenizer(folder: str, paragraphs: list[str]) -> int:
    """A byte-level BPE of exactly VOCAB tokens (<s> = 0, </s> = 1), as tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(paragraphs, trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<s>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    short = VOCAB - tok.get_vocab_size()
    if short > 0:  # a small corpus: fill up so every id the model can draw decodes
        tok.add_tokens([f"<fill{i}>" for i in range(short)])
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>",
                   "tokenizer_class": "PreTrainedTokenizerFast"}, f)
    return tok.get_vocab_size()


def write_checkpoint(folder: str, seed: int) -> dict:
    made = tiny.write_tiny(folder, seed=seed, variant="v4", quantized=False, full_trunk=True,
                           config_overrides=SIZES)
    paragraphs = corpus()
    made["tokenizer_vocab"] = write_tokenizer(folder, paragraphs)
    return made


def prompts(folder: str) -> list[list[int]]:
    """Token prompts of PROMPT_TOKENS lengths from different parts of the corpus (distinct
    starts: no prefix shared across jobs, so every job prefills, and exports, all of its rows)."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    paragraphs = corpus()
    out = []
    for i, n in enumerate(PROMPT_TOKENS):
        ids = []
        for p in paragraphs[97 * (i + 1):]:
            ids += tok.encode(p).ids
            if len(ids) >= n:
                break
        out.append(ids[:n])
    return out


# -- exllamav3's own run, recorded ---------------------------------------------------------

class Recorder:
    """Hooks on exllamav3's DeepseekV4MTPModel (one job at a time, batch row 0): the taps
    update_kv_from_target receives, by position; each draft pass's seed, p0 and drafts, and
    exllamav3's own final logits and confidences recomputed with its modules from the pass's
    state (its sample_from_state loop, read in architecture/deepseek_v4_mtp.py)."""

    def __init__(self, draft, target):
        self.draft, self.target = draft, target
        self.taps: dict[int, np.ndarray] = {}
        self.passes: list[dict] = []
        self.job = 0
        update, forward, sample = draft.update_kv_from_target, draft.forward, draft.sample_from_state

        def on_update(target_hidden, cache, params, lengths=None):
            start = int(params["cache_seqlens"].view(-1)[0])
            rows = torch.cat([t[0].float().cpu() for t in target_hidden], -1)
            n = rows.shape[0] if lengths is None else int(lengths[0])
            for i in range(n):
                self.taps[start + i] = rows[i].numpy().copy()
            return update(target_hidden, cache, params, lengths)

        def on_forward(input_ids, params, **kwargs):
            self.pending = {"job": self.job, "seed": int(input_ids.view(-1)[-1]),
                            "p0": int(params["cache_seqlens"].view(-1)[0])}
            return forward(input_ids, params, **kwargs)

        def on_sample(state, params):
            out = sample(state, params)
            rec = {**self.pending, "drafts": out[0, 1:].tolist()}
            try:
                rec["logits"], rec["confidence"] = self.exl3_logits(state, params, out)
            except Exception:  # keep exllamav3 running; the pass is left out of the comparison
                rec["error"] = traceback.format_exc()[-2000:]
                self.passes.append(rec)
                return out
            p0 = rec["p0"]
            window = range(max(p0 - self.draft.config.sliding_window, 0), p0)
            rec["taps_complete"] = all(p in self.taps for p in range(p0))
            rec["window_complete"] = all(p in self.taps for p in window)
            if rec["taps_complete"]:
                rec["rows"] = np.stack([self.taps[p] for p in range(p0)]) if p0 else None
            self.passes.append(rec)
            return out

        draft.update_kv_from_target, draft.forward, draft.sample_from_state = on_update, on_forward, on_sample

    @torch.inference_mode()
    def exl3_logits(self, state, params, out):
        import torch.nn.functional as F
        d = self.draft
        lm = d.own_head or self.target.modules[self.target.logit_layer_idx]
        base = lm.forward(lm.prepare_for_device(state, params), params).float()[0]
        w1 = d.markov_w1.embedding.weight.data.to(d.markov_w2.device)
        logits, embs = [], []
        for i in range(base.shape[0]):
            emb = F.embedding(out[:, i].to(w1.device), w1).half()
            embs.append(emb)
            bias = d.markov_w2.forward(emb.unsqueeze(1), params)[0, 0].float()
            logits.append((base[i].to(bias.device) + bias).cpu())
        xpre = params["dspark_prenorm"].to(d.confidence.device).half()
        me = torch.stack(embs, 1).to(d.confidence.device)
        conf = torch.sigmoid(d.confidence.forward(torch.cat((xpre, me), -1), params).float())
        return torch.stack(logits).numpy(), conf[0, :, 0].cpu().numpy()


def run_exl3(model_dir: str, token_prompts: list[list[int]], new_tokens: int) -> dict:
    from exllamav3 import Cache, Config, Generator, Job, Model, Tokenizer
    from exllamav3.generator.sampler import ArgmaxSampler
    config = Config.from_directory(model_dir)
    model = Model.from_config(config)
    draft = Model.from_config(config, component="mtp")
    width = draft.caps["default_draft_size"]
    cache = Cache(model, max_num_tokens=4096, max_history=width, max_batch_size=4)
    draft_cache = Cache(draft, max_num_tokens=4096, max_history=width, max_batch_size=4)
    draft.load(progressbar=False)
    model.load(progressbar=False, draft_model=draft)
    tokenizer = Tokenizer.from_config(config)
    generator = Generator(model, cache, tokenizer, draft_model=draft, draft_cache=draft_cache)
    rec = Recorder(draft, model)
    outputs = []
    for job_id, ids in enumerate(token_prompts):
        rec.job, rec.taps = job_id, {}
        job = Job(input_ids=torch.tensor([ids]), max_new_tokens=new_tokens, sampler=ArgmaxSampler(),
                  stop_conditions=[])
        generator.enqueue(job)
        generated, steps = [], 0
        while generator.num_remaining_jobs():
            steps += 1
            if steps > 4 * new_tokens + 50:
                raise RuntimeError(f"job {job_id}: no end after {steps} generator steps")
            for r in generator.iterate():
                generated += r.get("token_ids", torch.empty(0)).view(-1).tolist() if "token_ids" in r else []
        outputs.append(generated)
    errors = [r["error"] for r in rec.passes if "error" in r]
    stats = {"passes": len(rec.passes), "generated": [len(o) for o in outputs],
             "recording_errors": len(errors), "first_recording_error": errors[0] if errors else None,
             "draft_width": width, "taps_layers": sorted(draft.draft_verifier_params["export_state_layers"])}
    for m in (draft, model):
        m.unload()
    return {"passes": rec.passes, "stats": stats}


def convert(src: str, out: str, work: str, bits: float, mtp_bits: float, head_bits: float,
            timeout_s: int) -> dict:
    cmd = [sys.executable, "-m", "exllamav3.conversion.convert_model", "-i", src, "-o", out,
           "-w", work, "-b", str(bits), "--mtp_bits", str(mtp_bits), "--head_bits", str(head_bits),
           "-cr", "16", "-cc", "512"]
    t0 = time.time()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    tail = (done.stdout + done.stderr)[-3000:]
    if done.returncode:
        raise RuntimeError(f"convert_model exited {done.returncode}: {tail}")
    files = sorted(os.path.basename(f) for f in glob.glob(os.path.join(out, "*")))
    return {"command": " ".join(cmd[1:]), "seconds": round(time.time() - t0, 1), "files": files,
            "log_tail": tail[-1200:]}


# -- the same taps through this project's drafter -------------------------------------------

def margin(logits: np.ndarray) -> float:
    """The top logit's lead over the second."""
    a, b = np.sort(logits)[-2:][::-1]
    return float(a - b)


@torch.inference_mode()
def compare(drafter: Dsv41Drafter, passes: list[dict]) -> dict:
    """Per pass: our greedy chain from the same taps, seed and p0 (Dsv41Drafter.draft); then
    each position's logits with our Markov bias taken from exllamav3's previous draft, against
    exllamav3's own logits for that position: their largest difference, and for every
    disagreement both sides' logit margins between the two tokens (a near-tie: small on
    both sides, within the logits' difference)."""
    m, c, dev = drafter.model, drafter.config, drafter.device
    chains = same_chain = first_same = positions = same_pos = 0
    margins, disagreements, logit_diff, logit_scale, conf_diff = [], [], 0.0, 0.0, 0.0
    for rec in passes:
        if not rec.get("taps_complete") or "logits" not in rec:
            continue
        p0, width = rec["p0"], len(rec["drafts"])
        h = drafter.new_history()
        tokens = np.zeros(p0 + 1, np.int32)  # only the seed (the newest) and the length enter
        tokens[-1] = rec["seed"]
        h.reset(tokens, rec["rows"])
        ours = drafter.draft([DraftRequest(h, width)], want_probs=False)[0].tokens.tolist()
        chains += 1
        same_chain += ours == rec["drafts"]
        first_same += ours[:1] == rec["drafts"][:1]
        # the same pass through the model's stages, exposing its logits
        n, k = drafter.window, min(p0, drafter.window)
        ctx = torch.zeros((1, n, c.n_mtp_layers * c.head_dim), device=dev)
        ctx[0, n - k:] = m.encode_rows(torch.tensor(rec["rows"][p0 - k:], device=dev),
                                       torch.arange(p0 - k, p0, device=dev))
        valid = torch.zeros((1, n), dtype=torch.bool, device=dev)
        valid[0, n - k:] = True
        hidden = m.block_hidden(ctx.view(1, n, c.n_mtp_layers, c.head_dim), valid,
                                torch.tensor([rec["seed"]], device=dev), torch.tensor([p0], device=dev))
        z = m.head(hidden)
        previous = [rec["seed"]] + rec["drafts"][:-1]
        for i in range(width):
            emb = m.markov.embed(torch.tensor([previous[i]], device=dev))
            mine_l = m.markov.logits(z[:, i], emb)[0].double().cpu().numpy()
            theirs_l = rec["logits"][i].astype(np.float64)
            logit_diff = max(logit_diff, float(np.abs(mine_l - theirs_l).max()))
            logit_scale = max(logit_scale, float(np.abs(mine_l).max()))
            conf_diff = max(conf_diff, abs(float(m.confidence(hidden[:, i], emb)) - float(rec["confidence"][i])))
            positions += 1
            mine, theirs = int(mine_l.argmax()), rec["drafts"][i]
            if mine == theirs:
                same_pos += 1
                margins.append(margin(mine_l))
            else:
                disagreements.append({"job": rec["job"], "p0": p0, "position": i, "ours": mine,
                                      "exl3": theirs,
                                      "ours_margin": float(mine_l[mine] - mine_l[theirs]),
                                      "exl3_margin": float(theirs_l[theirs] - theirs_l[mine]),
                                      "logit_diff": float(np.abs(mine_l - theirs_l).max())})
    return {"passes_compared": chains, "chains_identical": same_chain,
            "first_draft_identical": first_same, "positions": positions,
            "positions_identical": same_pos, "max_logit_diff": logit_diff,
            "max_abs_logit": logit_scale,
            "agreeing_margin_min": min(margins) if margins else None,
            "agreeing_margin_p50": float(np.median(margins)) if margins else None,
            "disagreements": disagreements, "max_confidence_diff": conf_diff,
            "passes_without_taps": sum(1 for r in passes if not r.get("taps_complete"))}


@torch.inference_mode()
def routing_flip_study(drafter: Dsv41Drafter, passes: int = 160, seed: int = 0) -> dict:
    """What exllamav3's router does to our drafter alone: its expert CHOICE made as it makes it
    (hidden and gate in fp16, the noaux bias mean-centred in fp16: block_sparse_mlp_routing.py
    routing_sqrtsp, routing_ds3_nogroup's kHalf inputs), the weights kept float32, against our
    float32 router, on random taps (CPU, no exllamav3). A near-tie between the k-th and
    (k+1)-th expert flips the choice: the position's logits move by O(1), the others not at all."""
    from torch.nn import functional as F

    from remote_drafter.models.dsv41.modules.moe import MoE
    m, c, rng = drafter.model, drafter.config, np.random.default_rng(seed)
    exact = MoE.route

    def route_half(self, x):
        gate, bias = self.gate, self.bias
        scores = F.softplus(x.half().float() @ gate.half().float().T).sqrt()
        experts = (scores + (bias - bias.mean()).half().float()).topk(c.num_experts_per_tok, -1).indices
        exact_scores = F.softplus((x @ gate.T).to(self.numerics.wide)).sqrt().gather(-1, experts)
        weights = exact_scores / exact_scores.sum(-1, keepdim=True) * c.routed_scaling_factor
        return weights, experts

    diffs, flipped = [], 0
    n = drafter.window
    try:
        for _ in range(passes):
            p0 = int(rng.integers(12, 440))
            k = min(p0, n)
            rows = torch.tensor(rng.standard_normal((k, drafter.feature)).astype(np.float32))
            ctx = torch.zeros(1, n, c.n_mtp_layers * c.head_dim)
            ctx[0, n - k:] = m.encode_rows(rows, torch.arange(p0 - k, p0))
            valid = torch.zeros(1, n, dtype=torch.bool)
            valid[0, n - k:] = True
            block = (ctx.view(1, n, c.n_mtp_layers, -1), valid,
                     torch.tensor([int(rng.integers(0, drafter.vocab_size))]), torch.tensor([p0]))
            MoE.route = exact
            ours = m.head(m.block_hidden(*block))[0]
            MoE.route = route_half
            half = m.head(m.block_hidden(*block))[0]
            diffs += (ours - half).abs().max(-1).values.tolist()
            flipped += int((ours.argmax(-1) != half.argmax(-1)).sum())
    finally:
        MoE.route = exact
    diffs = np.array(diffs)
    return {"passes": passes, "positions": len(diffs), "max_logit_diff": float(diffs.max()),
            "positions_moved_over_0.1": int((diffs > 0.1).sum()),
            "positions_moved_at_all": int((diffs > 0).sum()), "argmax_changed": flipped}


def stored_drafter(folder: str) -> dict:
    """How exllamav3 stored the drafter's tensors (expert 0 standing for every expert)."""
    from remote_drafter.models.dsv41 import checkpoint
    stored = checkpoint.stored_drafter_tensors(folder)
    shown = {n: [s.dtype, list(s.shape)] for n, s in sorted(stored.items())
             if ".experts." not in n or ".experts.0." in n}
    return {"tensors": len(stored), "trellis": sum(n.endswith(".trellis") for n in stored),
            "shown": shown}


def check(label: str, model_dir: str, drafter_folder: str, token_prompts, new_tokens: int) -> dict:
    """exllamav3 runs model_dir; this project's drafter loads drafter_folder (the source
    checkpoint, or exllamav3's output where it quantised the drafter)."""
    t0 = time.time()
    ran = run_exl3(model_dir, token_prompts, new_tokens)
    result = {"label": label, "drafter_folder": os.path.basename(drafter_folder)}
    if drafter_folder == model_dir:
        result["exl3_stored_drafter"] = stored_drafter(model_dir)
    drafter = Dsv41Drafter.load(drafter_folder, device="cuda", dtype=torch.float32)
    assert drafter.config.variant == "v4"
    result.update({"exl3": ran["stats"], **compare(drafter, ran["passes"]),
                   "served_exl3_linears": len(drafter.model.served),
                   "seconds": round(time.time() - t0, 1)})
    del drafter
    torch.cuda.empty_cache()
    return result


def print_table(results: list[dict]) -> None:
    print(f"{'model':<19}{'passes':>7}{'chains same':>12}{'1st same':>9}{'positions':>10}"
          f"{'same':>6}{'max |dlogit|':>13}{'|logit| max':>12}{'min margin':>11}{'max dconf':>10}")
    for r in results:
        if "error" in r:
            print(f"{r['label']:<19} failed: {r['error'].strip().splitlines()[-1][:100]}")
            continue
        print(f"{r['label']:<19}{r['passes_compared']:>7}{r['chains_identical']:>12}"
              f"{r['first_draft_identical']:>9}{r['positions']:>10}{r['positions_identical']:>6}"
              f"{r['max_logit_diff']:>13.2e}{r['max_abs_logit']:>12.2f}"
              f"{r['agreeing_margin_min'] or 0:>11.2e}{r['max_confidence_diff']:>10.2e}")
        for d in r["disagreements"][:10]:
            print(f"   differ: job {d['job']} p0 {d['p0']} draft {d['position']}: ours {d['ours']} "
                  f"exl3 {d['exl3']}; logit margins ours {d['ours_margin']:.2e}, exl3's "
                  f"{d['exl3_margin']:.2e}; largest logit difference {d['logit_diff']:.2e}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="dsv4-exl3.json")
    ap.add_argument("--work", default="/tmp/dsv4-exl3")
    ap.add_argument("--new-tokens", type=int, default=40)
    ap.add_argument("--bits", type=float, default=4.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget-s", type=int, default=560,
                    help="wall time for the whole run: the conversion gets what is left, less a "
                         "minute for its check (skipped, and said so, below two minutes)")
    ap.add_argument("--skip", default="", help="comma list of: unconverted, converted, converted_drafter")
    ap.add_argument("--routing-study", action="store_true",
                    help="instead, on the CPU without exllamav3: our drafter with exllamav3's "
                         "fp16 router choice against our float32 one (routing_flip_study)")
    args = ap.parse_args(argv)
    if args.routing_study:
        src = os.path.join(args.work, "src")
        write_checkpoint(src, args.seed)
        study = routing_flip_study(Dsv41Drafter.load(src, device="cpu", dtype=torch.float32),
                                   seed=args.seed)
        with open(args.out, "w") as f:
            json.dump({"sizes": SIZES, "routing_flip_study": study}, f, indent=1)
        print(study)
        return 0
    os.environ.setdefault("EXL3_DSPARK_CONF", "0")  # read when the drafter is built
    skip = set(filter(None, args.skip.split(",")))
    src = os.path.join(args.work, "src")
    report = {"sizes": SIZES, "prompt_tokens": list(PROMPT_TOKENS), "new_tokens": args.new_tokens,
              "results": [], "torch": torch.__version__}

    def save():
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)

    t0 = time.time()
    report["checkpoint"] = {k: v for k, v in write_checkpoint(src, args.seed).items() if k != "config"}
    token_prompts = prompts(src)
    import exllamav3  # builds its CUDA extension on first import (minutes)
    report["exllamav3"] = {"version": getattr(exllamav3, "__version__", "?"),
                           "import_s": round(time.time() - t0, 1)}
    save()
    # label -> (drafter bits, head bits) of exllamav3's conversion; None: the checkpoint itself
    runs = {"unconverted": None, "converted": (16, 16), "converted_drafter": (args.bits, 6)}
    for label, quantised in runs.items():
        if label in skip:
            continue
        model_dir = src if quantised is None else os.path.join(args.work, label)
        try:
            if quantised:
                left = args.budget_s - (time.time() - t0) - 60
                if left < 60:
                    raise RuntimeError(f"skipped: {left + 60:.0f} s of the budget left")
                report.setdefault("conversions", {})[label] = convert(
                    src, model_dir, os.path.join(args.work, f"{label}-work"), args.bits, *quantised, int(left))
                save()
            drafter_folder = model_dir if label == "converted_drafter" else src
            report["results"].append(check(label, model_dir, drafter_folder, token_prompts, args.new_tokens))
        except Exception:
            report["results"].append({"label": label, "error": traceback.format_exc()[-4000:]})
        save()
    print_table(report["results"])
    return 0 if all("error" not in r for r in report["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
