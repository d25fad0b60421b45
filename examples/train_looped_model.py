"""Train a small Ouro-architecture looped model on a task where more loops help, and save it in the
Hugging Face format (config.json, model.safetensors, tokenizer.json, generation_config.json, a model card
and a held-out task file for benchmarks/quality.py).

The task: multi-hop pointer chasing. Each prompt draws a fresh random cycle f over K nodes and lists it
as K *pair tokens* "s>d" (one token per edge, in random order), then `?` and a start node q. The answer is
f^H(q), f^2H(q), ..., (A tokens, each H hops after the previous one), then `<|endoftext|>`.

Why it needs the loops: one hop is one attention lookup (the pair token whose source is the current node
carries its destination), so a position can move only a few hops per pass of the layer stack. With one
layer per loop and H = 4, loops 1-2 cannot answer (the shipped model, models/pointer-chase: whole-answer
exact match 0.000 / 0.000 / 0.974 / 0.9985 from loops 1 / 2 / 3 / 4), and every answer token needs its own
H hops from the previous answer (no shortcut through earlier answers: the cycle is longer than A*H). The
loss is applied at every loop, as Ouro is trained. Reading answer tokens from loop 2 (ourobatch's
deferred mode) therefore visibly costs accuracy, which is what the quality harness must be able to show.

    python examples/train_looped_model.py --out models/pointer-chase                        # ~7 min on a GPU
    python examples/train_looped_model.py --out /tmp/toy --toy --minutes 0.2 --device cpu   # smoke test
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from engine.config import OuroConfig
from engine.model import OuroForCausalLM

EOS, BOS, QUERY = 0, 1, 2  # <|endoftext|>, <|im_start|>, ?
FIRST_NODE = 3  # nodes n0..n{K-1}, then pair tokens "ns>nd" at FIRST_NODE + K + s * K + d


def vocab_size(nodes: int) -> int:
    return FIRST_NODE + nodes + nodes * nodes


def make_batch(n: int, nodes: int, hops: int, answers: int, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """Token ids [n, P + answers + 1] (prompt, answer, eos) and the prompt length P = nodes + 3."""
    if answers * hops >= nodes:
        raise ValueError(f"answers * hops = {answers * hops} must be < nodes = {nodes}: otherwise the cycle "
                         f"wraps and a later answer can be copied from an earlier token")
    cycle = torch.argsort(torch.rand(n, nodes, generator=gen), dim=1)  # a random cycle through all nodes
    succ = torch.empty_like(cycle).scatter_(1, cycle, cycle.roll(-1, dims=1))  # f(cycle[i]) = cycle[i + 1]
    src = torch.argsort(torch.rand(n, nodes, generator=gen), dim=1)  # edges listed in random order
    pairs = FIRST_NODE + nodes + src * nodes + succ.gather(1, src)
    q = torch.randint(0, nodes, (n,), generator=gen)
    cur, outs = q.clone(), []
    for _ in range(answers):
        for _ in range(hops):
            cur = succ.gather(1, cur[:, None]).squeeze(1)
        outs.append(cur)
    prompt = torch.cat([torch.full((n, 1), BOS), pairs, torch.full((n, 1), QUERY), (q + FIRST_NODE)[:, None]], 1)
    answer = torch.cat([torch.stack(outs, 1) + FIRST_NODE, torch.full((n, 1), EOS)], dim=1)
    return torch.cat([prompt, answer], dim=1), prompt.shape[1]


def dense_forward(model: OuroForCausalLM, ids: torch.Tensor) -> list[torch.Tensor]:
    """Every loop's logits over whole sequences, no cache: ids [b, L] -> T x [b, L, V]."""
    return [model.logits(h) for h in model.dense_loops(ids)]


@torch.no_grad()
def per_loop_accuracy(model, task: dict, n: int, gen: torch.Generator, device, chunk: int = 1000) -> list[float]:
    """Exact match of the whole answer (eos included) when every token, the first one too, is read
    greedily from loop t: the model truncated to t loops."""
    T = model.config.total_ut_steps
    correct = [0] * T
    for start in range(0, n, chunk):
        ids, P = make_batch(min(chunk, n - start), task["nodes"], task["hops"], task["answers"], gen)
        ids = ids.to(device)
        target = ids[:, P:]
        for loop in range(T):
            seq = ids[:, :P]
            for _ in range(target.shape[1]):
                nxt = dense_forward(model, seq)[loop][:, -1].argmax(-1)
                seq = torch.cat([seq, nxt[:, None]], dim=1)
            correct[loop] += int((seq[:, P:] == target).all(1).sum())
    return [c / n for c in correct]


def write_tokenizer(out: Path, nodes: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<|endoftext|>": EOS, "<|im_start|>": BOS, "?": QUERY}
    vocab.update({f"n{i}": FIRST_NODE + i for i in range(nodes)})
    vocab.update({f"n{s}>n{d}": FIRST_NODE + nodes + s * nodes + d for s in range(nodes) for d in range(nodes)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins tokens with spaces
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>"])  # eos and bos (ids unchanged): skip_special_tokens
    tok.save(str(out / "tokenizer.json"))
    # the chat template the shipped model carries (a user message = one task), and the tokens it names
    template = Path(__file__).resolve().parents[1] / "models" / "pointer-chase" / "chat_template.jinja"
    if template.resolve() != (out / "chat_template.jinja").resolve():
        shutil.copyfile(template, out / "chat_template.jinja")
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>", "eos_token": "<|endoftext|>",
         "model_max_length": 512, "clean_up_tokenization_spaces": False}, indent=2) + "\n")


MODEL_CARD = """\
# pointer-chase: a small trained Ouro-architecture looped model

A test bed for ourobatch's quality harness: a looped model with Ouro's architecture, tensor names and
config (T = {T} loops) where more loops clearly help. Random-weight checkpoints can show speed but not
quality; this one shows what reading tokens from a shallower loop costs.

## Training
`examples/train_looped_model.py {argv}`: {steps} steps of batch {batch} ({seconds:.0f} s on {device}),
AdamW (lr {lr}, cosine decay), bf16 autocast on CUDA, with a cross-entropy loss on the answer tokens at
every loop (loop weights {loop_weights}), as Ouro is trained. Every batch is fresh random data.

## Task
Multi-hop pointer chasing. Each prompt has a fresh random cycle f over {nodes} nodes, listed as {nodes}
pair tokens `ns>nd` (one token per edge, random order), then `?` and a start node q:
`<|im_start|> (ns>nd) x {nodes} ? nq`. The answer is f^{hops}(q), then {more} more nodes, each {hops} hops
after the previous one, then `<|endoftext|>` ({answers} answer tokens + eos; {nodes} > {answers} x {hops}, so
no answer repeats an earlier token). One hop is one attention lookup, so a position can move only a few
hops per loop, and a readout from fewer loops should lose accuracy; the table below says how much.

Vocabulary ({vocab} tokens, `tokenizer.json`, whitespace-separated words): `<|endoftext|>`=0 (eos),
`<|im_start|>`=1 (bos), `?`=2, nodes `n0..n{last}` = 3.., then the pair tokens.

## Model
hidden {hidden}, {layers} layer(s) applied in {T} loops, {heads} heads of dim {head_dim},
intermediate {intermediate}, untied lm_head, {params:.2f} M parameters, float32 weights.

## Accuracy per loop
Exact match of the whole answer (eos included) on {eval_n} fresh samples, greedy, every token (the first
one too) read from loop t, i.e. the model truncated to t loops (dense evaluation in the training script):

| loop t | exact match |
|---|---|
{rows}

`tests/test_pointer_chase_model.py` checks these numbers through the engine on `heldout_tasks.jsonl`
({heldout} samples drawn after training, with their own seed) and that deferred decoding (answer tokens
read from loop 2) is clearly worse; docs/quality.md has the full quality table for every mode.
"""


def save_checkpoint(model: OuroForCausalLM, raw_config: dict, out: Path, task: dict, accs: list[float],
                    info: dict, heldout: int, gen: torch.Generator) -> None:
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.float32).contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(raw_config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": BOS, "eos_token_id": EOS}) + "\n")
    write_tokenizer(out, task["nodes"])
    ids, P = make_batch(heldout, task["nodes"], task["hops"], task["answers"], gen)
    with open(out / "heldout_tasks.jsonl", "w") as f:
        for row in ids.tolist():
            f.write(json.dumps({"prompt_token_ids": row[:P], "target_token_ids": row[P:-1]}) + "\n")
    rows = "\n".join(f"| {t + 1} | {a:.4f} |" for t, a in enumerate(accs))
    cfg = raw_config
    (out / "README.md").write_text(MODEL_CARD.format(
        T=cfg["total_ut_steps"], rows=rows, heldout=heldout, more=task["answers"] - 1, last=task["nodes"] - 1,
        vocab=cfg["vocab_size"], hidden=cfg["hidden_size"], layers=cfg["num_hidden_layers"],
        heads=cfg["num_attention_heads"], head_dim=cfg["head_dim"], intermediate=cfg["intermediate_size"],
        **task, **{**info, "params": info["params"] / 1e6}))


def build_model(args) -> tuple[OuroForCausalLM, dict]:
    heads = max(2, args.hidden // 64)
    raw = dict(architectures=["OuroForCausalLM"], model_type="ouro", vocab_size=vocab_size(args.nodes),
               hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
               num_attention_heads=heads, num_key_value_heads=heads, head_dim=args.hidden // heads,
               rope_theta=10000.0, rope_scaling=None, rms_norm_eps=1e-6, total_ut_steps=4,
               early_exit_threshold=1.0, max_position_embeddings=512, tie_word_embeddings=False,
               bos_token_id=BOS, eos_token_id=EOS, torch_dtype="float32")
    torch.manual_seed(args.seed)
    model = OuroForCausalLM(OuroConfig.from_dict(raw)).to(args.device)
    for name, p in model.named_parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=1.0 if "embed" in name else 0.02)
    return model, raw


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[float]]:
    """The checked command line (--toy's sizes applied) and the loss weight of each loop."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--minutes", type=float, default=6.8, help="training time budget (the lr schedule follows it)")
    ap.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (default: time only)")
    ap.add_argument("--toy", action="store_true", help="tiny sizes (CPU smoke test)")
    ap.add_argument("--nodes", type=int, default=20)
    ap.add_argument("--hops", type=int, default=4)
    ap.add_argument("--answers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--loop-weights", default="1,1,1,1", help="relative loss weight of each loop")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-n", type=int, default=2000)
    ap.add_argument("--heldout", type=int, default=500)
    args = ap.parse_args(argv)
    try:  # fail before training, not after it, when tokenizer.json cannot be written
        import tokenizers  # noqa: F401
    except ImportError:
        ap.error("the tokenizers package writes tokenizer.json: pip install tokenizers (or ourobatch[text])")
    if args.toy:
        args.nodes, args.hops, args.answers, args.hidden, args.batch = 7, 2, 2, 32, 32
        args.eval_n, args.heldout = min(args.eval_n, 200), min(args.heldout, 50)
    try:
        weights = [float(w) for w in args.loop_weights.split(",")]
    except ValueError:
        weights = []
    if len(weights) != 4 or min(weights) < 0 or sum(weights) <= 0:
        ap.error(f"--loop-weights: need 4 comma-separated non-negative numbers, got {args.loop_weights!r}")
    for name in ("nodes", "hops", "answers", "hidden", "layers", "batch", "eval_n", "heldout"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.answers * args.hops >= args.nodes:
        ap.error(f"--answers x --hops = {args.answers * args.hops} must be < --nodes = {args.nodes} (a longer "
                 f"chain wraps around the cycle, and later answers could be copied from earlier tokens)")
    if args.hidden % max(2, args.hidden // 64):
        ap.error(f"--hidden must split into equal heads (an even number below 128, else a multiple of 64), "
                 f"got {args.hidden}")
    return args, weights


def main(argv: list[str] | None = None) -> int:
    args, weights = parse_args(argv)
    argv_text = " ".join(argv) if argv is not None else " ".join(__import__("sys").argv[1:])
    task = dict(nodes=args.nodes, hops=args.hops, answers=args.answers)
    model, raw = build_model(args)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    gen = torch.Generator().manual_seed(args.seed)
    budget, start, step = args.minutes * 60, time.time(), 0
    cuda = args.device.startswith("cuda")
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)
    w = torch.tensor(weights) / sum(weights)
    while time.time() - start < budget and (args.max_steps is None or step < args.max_steps):
        ids, P = make_batch(args.batch, args.nodes, args.hops, args.answers, gen)
        ids = ids.to(args.device, non_blocking=True)
        frac = (time.time() - start) / budget
        if args.max_steps is not None:
            frac = max(frac, step / args.max_steps)
        for g in opt.param_groups:
            g["lr"] = args.lr * min(1.0, (step + 1) / 300) * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))
        with amp:
            logits = dense_forward(model, ids[:, :-1])
        target = ids[:, P:]
        losses = [F.cross_entropy(lg[:, P - 1:].float().reshape(-1, lg.shape[-1]), target.reshape(-1))
                  for lg in logits]
        loss = sum(wt * x for wt, x in zip(w.tolist(), losses))  # a loss at every loop, as Ouro is trained
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 500 == 0:
            exact = [float((lg[:, P - 1:].argmax(-1) == target).all(1).float().mean()) for lg in logits]
            print(f"step {step} t={time.time() - start:.0f}s loss/loop "
                  + " ".join(f"{x.item():.3f}" for x in losses) + "  teacher-forced exact/loop "
                  + " ".join(f"{a:.3f}" for a in exact), flush=True)
        step += 1
    seconds = time.time() - start
    model.eval()
    accs = per_loop_accuracy(model, task, args.eval_n, torch.Generator().manual_seed(10_000 + args.seed),
                             args.device)
    print("per-loop exact match:", " ".join(f"loop{t + 1}={a:.4f}" for t, a in enumerate(accs)), flush=True)
    info = dict(steps=step, batch=args.batch, seconds=seconds, device=args.device, eval_n=args.eval_n,
                lr=args.lr, loop_weights=args.loop_weights, argv=argv_text,
                params=sum(p.numel() for p in model.parameters()))
    out = Path(args.out)
    save_checkpoint(model, raw, out, task, accs, info, args.heldout, torch.Generator().manual_seed(20_000 + args.seed))
    (out / "training.json").write_text(json.dumps(dict(task=task, accuracy_per_loop=accs, **info), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
