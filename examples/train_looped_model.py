"""Train a small Ouro-architecture looped model on a task where more loops help, and save it in the
Hugging Face format (config.json, model.safetensors, tokenizer.json, generation_config.json, a model card
and a held-out task file for benchmarks/quality.py).

The task: multi-hop pointer chasing. The prompt lists a random permutation f of K node tokens as K pairs
"s d" (in random order), then "? q =". The answer is f^H(q), f^2H(q), f^3H(q) (each answer token is H
hops from the previous one), then <|endoftext|>. One hop needs roughly one pass of the layer stack
(find the pair whose source is the current node, read its destination), so with the loss at every loop,
as Ouro is trained, loop t learns to be t hops along: loop 4 can answer H = 4, loops 1-2 cannot. Every
answer token needs all four loops, so reading tokens from loop 2 (deferred mode) visibly costs accuracy.

    python examples/train_looped_model.py --out models/pointer-chase-4 --minutes 6          # on a GPU
    python examples/train_looped_model.py --out /tmp/toy --toy --minutes 0.2 --device cpu   # smoke test
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from ourobatch.engine.config import OuroConfig
from ourobatch.engine.model import OuroForCausalLM

EOS, BOS, EQ, QUERY = 0, 1, 2, 3
FIRST_NODE = 4


def task_config(args) -> dict:
    return dict(nodes=args.nodes, hops=args.hops, answers=args.answers)


def make_batch(n: int, nodes: int, hops: int, answers: int, gen: torch.Generator, device) -> tuple:
    """Token ids [n, P + answers + 1] and the index of the first answer token (= P)."""
    perm = torch.argsort(torch.rand(n, nodes, generator=gen), dim=1)  # f(i) = perm[i]
    order = torch.argsort(torch.rand(n, nodes, generator=gen), dim=1)  # pairs listed in random order
    src = order
    dst = perm.gather(1, src)
    pairs = torch.stack([src, dst], dim=2).reshape(n, 2 * nodes) + FIRST_NODE
    q = torch.randint(0, nodes, (n,), generator=gen)
    cur, outs = q.clone(), []
    for _ in range(answers):
        for _ in range(hops):
            cur = perm.gather(1, cur[:, None]).squeeze(1)
        outs.append(cur.clone())
    prompt = torch.cat([torch.full((n, 1), BOS), pairs, torch.full((n, 1), QUERY), (q + FIRST_NODE)[:, None],
                        torch.full((n, 1), EQ)], dim=1)
    answer = torch.cat([torch.stack(outs, 1) + FIRST_NODE, torch.full((n, 1), EOS)], dim=1)
    return torch.cat([prompt, answer], dim=1).to(device), prompt.shape[1]


def dense_forward(model: OuroForCausalLM, ids: torch.Tensor) -> list[torch.Tensor]:
    """All loops over whole sequences, no cache (training and evaluation). Returns each loop's logits."""
    cfg = model.config
    b, L = ids.shape
    pos = torch.arange(L, device=ids.device)
    h = model.model.embed_tokens(ids)
    outs = []
    for _ in range(cfg.total_ut_steps):
        for layer in model.model.layers:
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.q_proj(x).view(b, L, attn.num_heads, attn.head_dim)
            k = attn.k_proj(x).view(b, L, attn.num_kv_heads, attn.head_dim)
            v = attn.v_proj(x).view(b, L, attn.num_kv_heads, attn.head_dim)
            q = model.rope(q.reshape(b * L, attn.num_heads, -1), pos.repeat(b)).view(b, L, attn.num_heads, -1)
            k = model.rope(k.reshape(b * L, attn.num_kv_heads, -1), pos.repeat(b)).view(b, L, attn.num_kv_heads, -1)
            a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                               enable_gqa=attn.num_heads != attn.num_kv_heads)
            h = h + layer.input_layernorm_2(attn.o_proj(a.transpose(1, 2).reshape(b, L, -1)))
            h = h + layer.post_attention_layernorm_2(layer.mlp(layer.post_attention_layernorm(h)))
        h = model.model.norm(h)
        outs.append(model.lm_head(h))
    return outs


@torch.no_grad()
def per_loop_accuracy(model, task: dict, n: int, gen: torch.Generator, device) -> list[float]:
    """Exact match of the whole answer when every answer token is read greedily from loop t."""
    ids, P = make_batch(n, task["nodes"], task["hops"], task["answers"], gen, device)
    target = ids[:, P:]
    accs = []
    for loop in range(model.config.total_ut_steps):
        seq = ids[:, :P]
        for _ in range(target.shape[1]):
            nxt = dense_forward(model, seq)[loop][:, -1].argmax(-1)
            seq = torch.cat([seq, nxt[:, None]], dim=1)
        accs.append(float((seq[:, P:] == target).all(1).float().mean()))
    return accs


def save_checkpoint(model: OuroForCausalLM, raw_config: dict, out: Path, task: dict, accs: list[float],
                    train_info: dict, heldout: int, gen: torch.Generator) -> None:
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.float32).contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(raw_config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": BOS, "eos_token_id": EOS}) + "\n")
    vocab = {"<|endoftext|>": EOS, "<|im_start|>": BOS, "=": EQ, "?": QUERY}
    vocab.update({f"n{i}": FIRST_NODE + i for i in range(task["nodes"])})
    try:
        from tokenizers import Tokenizer, models, pre_tokenizers, decoders

        tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
        tok.save(str(out / "tokenizer.json"))
    except ImportError:
        print("tokenizers is not installed: no tokenizer.json written")
    ids, P = make_batch(heldout, task["nodes"], task["hops"], task["answers"], gen, "cpu")
    with open(out / "heldout_tasks.jsonl", "w") as f:
        for row in ids.tolist():
            f.write(json.dumps({"prompt_token_ids": row[:P], "target_token_ids": row[P:-1]}) + "\n")
    lines = "\n".join(f"| {t + 1} | {a:.3f} |" for t, a in enumerate(accs))
    (out / "README.md").write_text(f"""# pointer-chase: a small trained Ouro-architecture looped model

A test bed for ourobatch's quality harness: a looped model (Ouro architecture, tensor names and config,
T = {raw_config['total_ut_steps']} loops) where more loops clearly help. Trained by
`examples/train_looped_model.py` ({train_info['steps']} steps, batch {train_info['batch']},
{train_info['seconds']:.0f} s on {train_info['device']}), with the loss at every loop as Ouro is trained.

Task: multi-hop pointer chasing over a random permutation of {task['nodes']} nodes given in the prompt as
pairs "s d"; the answer is f^{task['hops']}(q), then {task['answers'] - 1} more tokens each {task['hops']}
hops further, then `<|endoftext|>`. Prompt tokens: `<|im_start|> (s d) x {task['nodes']} ? q =`.
Vocabulary: `<|endoftext|>`=0, `<|im_start|>`=1, `=`=2, `?`=3, nodes `n0..n{task['nodes'] - 1}` = 4..
Model: hidden {raw_config['hidden_size']}, {raw_config['num_hidden_layers']} layers,
{raw_config['num_attention_heads']} heads, intermediate {raw_config['intermediate_size']},
{train_info['params'] / 1e6:.2f} M parameters, float32 weights.

Exact-match accuracy of the whole answer on {train_info['eval_n']} fresh samples, greedy, every answer
token read from loop t (dense evaluation in the training script):

| loop t | accuracy |
|---|---|
{lines}

`heldout_tasks.jsonl` ({heldout} samples drawn after training) is the task file for
`benchmarks/quality.py`.
""")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--minutes", type=float, default=6.0, help="training time budget")
    ap.add_argument("--toy", action="store_true", help="tiny sizes (CPU smoke test)")
    ap.add_argument("--nodes", type=int, default=16)
    ap.add_argument("--hops", type=int, default=4)
    ap.add_argument("--answers", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--curriculum", action="store_true",
                    help="start at 1 hop and add one whenever the last loop's teacher-forced token accuracy "
                         "passes 0.9, up to --hops")
    args = ap.parse_args(argv)
    if args.toy:
        args.nodes, args.hops, args.answers, args.hidden, args.batch = 6, 2, 2, 32, 32
    task = task_config(args)
    heads = max(2, args.hidden // 64)
    raw = dict(architectures=["OuroForCausalLM"], model_type="ouro", vocab_size=FIRST_NODE + args.nodes,
               hidden_size=args.hidden, intermediate_size=3 * args.hidden, num_hidden_layers=args.layers,
               num_attention_heads=heads, num_key_value_heads=heads, head_dim=args.hidden // heads,
               rope_theta=10000.0, rope_scaling=None, rms_norm_eps=1e-6, total_ut_steps=4,
               early_exit_threshold=1.0, max_position_embeddings=512, tie_word_embeddings=False,
               bos_token_id=BOS, eos_token_id=EOS, torch_dtype="float32")
    torch.manual_seed(args.seed)
    model = OuroForCausalLM(OuroConfig.from_dict(raw)).to(args.device)
    for name, p in model.named_parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.02 if "embed" not in name else 1.0)
        elif name.endswith("bias"):
            torch.nn.init.zeros_(p)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    gen = torch.Generator().manual_seed(args.seed)
    budget, start, step = args.minutes * 60, time.time(), 0
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if args.device.startswith("cuda") else torch.autocast(
        "cpu", enabled=False)
    T = model.config.total_ut_steps
    hops = 1 if args.curriculum else args.hops
    while time.time() - start < budget:
        ids, P = make_batch(args.batch, args.nodes, hops, args.answers, gen, args.device)
        frac = (time.time() - start) / budget
        for g in opt.param_groups:
            g["lr"] = args.lr * min(1.0, (step + 1) / 200) * 0.5 * (1 + math.cos(math.pi * frac))
        with amp:
            logits = dense_forward(model, ids[:, :-1])
        target = ids[:, P:]
        losses = [F.cross_entropy(lg[:, P - 1:].float().reshape(-1, lg.shape[-1]), target.reshape(-1))
                  for lg in logits]
        loss = sum(losses) / T  # a loss at every loop, as Ouro is trained
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 and hops < args.hops:
            acc = float((logits[-1][:, P - 1:].argmax(-1) == target).float().mean())
            if acc > 0.9:
                hops += 1
                print(f"step {step}: last-loop token accuracy {acc:.3f}, curriculum -> {hops} hops", flush=True)
        if step % 500 == 0:
            print(f"step {step} t={time.time() - start:.0f}s hops={hops} loss per loop "
                  + " ".join(f"{x.item():.3f}" for x in losses), flush=True)
        step += 1
    seconds = time.time() - start
    model.eval()
    eval_n = 2000 if not args.toy else 200
    accs = per_loop_accuracy(model, task, eval_n, torch.Generator().manual_seed(10_000 + args.seed), args.device)
    print("per-loop exact match:", " ".join(f"loop{t + 1}={a:.3f}" for t, a in enumerate(accs)), flush=True)
    info = dict(steps=step, batch=args.batch, seconds=seconds, device=args.device, eval_n=eval_n,
                params=sum(p.numel() for p in model.parameters()))
    save_checkpoint(model, raw, Path(args.out), task, accs, info, 500 if not args.toy else 50,
                    torch.Generator().manual_seed(20_000 + args.seed))
    (Path(args.out) / "training.json").write_text(json.dumps(dict(task=task, accuracy_per_loop=accs, **info), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
