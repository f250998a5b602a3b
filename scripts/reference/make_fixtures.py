"""Generates the PyTorch fixtures that `cargo test` compares against (tests/fixtures/), and
checks that a `standard` checkpoint loads unchanged in transformers' LlamaForCausalLM.

    python scripts/reference/make_fixtures.py                          # write fixtures + HF check
    python scripts/reference/make_fixtures.py --attnres target/release/attnres   # also check the CLI

Each fixture directory holds a checkpoint (config.json + model.safetensors) with *non-zero*
pseudo-queries and non-trivial gains, batch.json (input_ids, targets) and expected.safetensors
(logits, loss and grad.<name> for every parameter), computed in float64 from the f32 weights.
The training-trajectory fixtures (tests/fixtures/trajectory/) come from make_trajectory.py.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(__file__))
import reference as ref  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(ROOT, "tests", "fixtures")

BASE = dict(
    model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=48, hidden_size=32,
    intermediate_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
    head_dim=8, max_position_embeddings=16, rms_norm_eps=1e-5, rope_theta=10000.0,
    initializer_range=0.02, hidden_act="silu", attention_bias=False, mlp_bias=False,
    attention_dropout=0.0, torch_dtype="float32",
)

CASES = {
    # name: (residual, num_blocks, tie_word_embeddings)
    "standard": ("standard", 1, True),
    "full": ("full", 6, False),
    "block3": ("block", 3, True),  # S = 2: blocks align with layers
    "block2": ("block", 2, False),  # S = 3: a block spans attention and MLP of different layers
}


def write_fixture(name, residual, num_blocks, tie, gen):
    cfg = dict(BASE, residual=residual, num_blocks=num_blocks, tie_word_embeddings=tie)
    P = ref.random_params(cfg, gen, gain_std=0.2, query_std=0.5, weight_std=0.2)
    B, T = 2, 7
    ids = torch.randint(0, cfg["vocab_size"], (B, T), generator=gen)
    targets = torch.randint(0, cfg["vocab_size"], (B, T), generator=gen)
    for t in P.values():
        t.requires_grad_(True)
    logits = ref.forward(P, cfg, ids)
    loss = ref.loss_fn(logits, targets)
    loss.backward()
    d = os.path.join(OUT, name)
    ref.save(d, cfg, P)
    with open(os.path.join(d, "batch.json"), "w") as f:
        json.dump({"input_ids": ids.tolist(), "targets": targets.tolist()}, f)
    from safetensors.torch import save_file

    exp = {"logits": logits.detach(), "loss": loss.detach()}
    exp.update({f"grad.{k}": v.grad for k, v in P.items()})
    save_file({k: v.to(torch.float32).contiguous() for k, v in exp.items()}, os.path.join(d, "expected.safetensors"))
    print(f"{name}: loss {loss.item():.6f}, {len(P)} tensors")
    return d, cfg, P, ids


def hf_logits(dirname, ids):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(dirname, dtype=torch.float64, attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--attnres", help="path to a built attnres binary: also check its init/forward against transformers")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(20260315)
    os.makedirs(OUT, exist_ok=True)
    results = {name: write_fixture(name, *case, gen) for name, case in CASES.items()}

    # transformers must load the standard checkpoint unchanged and agree with the reference.
    d, cfg, P, ids = results["standard"]
    want = ref.forward({k: v.detach() for k, v in P.items()}, cfg, ids)
    got = hf_logits(d, ids)
    err = (got - want).abs().max().item()
    print(f"transformers LlamaForCausalLM vs reference on the standard fixture: max |diff| = {err:.3e}")
    assert err < 1e-5, err

    if args.attnres:
        with tempfile.TemporaryDirectory() as tmp:
            ck = os.path.join(tmp, "ck")
            subprocess.run([args.attnres, "init", "--out", ck, "--seed", "7", "--preset", "tiny",
                            "--set", "residual=standard", "--set", "num_key_value_heads=2",
                            "--set", "tie_word_embeddings=false", "--set", "initializer_range=0.2"], check=True)
            ids = torch.randint(0, 512, (3, 20), generator=gen)
            with open(os.path.join(tmp, "batch.json"), "w") as f:
                json.dump({"input_ids": ids.tolist()}, f)
            out = os.path.join(tmp, "out.safetensors")
            subprocess.run([args.attnres, "forward", "--model", ck, "--batch", os.path.join(tmp, "batch.json"), "--out", out], check=True)
            from safetensors.torch import load_file

            ours = load_file(out)["logits"].to(torch.float64)
            theirs = hf_logits(ck, ids)
            err = (ours - theirs).abs().max().item()
            scale = theirs.abs().max().item()
            print(f"attnres forward vs transformers on an `attnres init` standard checkpoint: max |diff| = {err:.3e} (max |logit| {scale:.2f})")
            assert err < 1e-4 * max(1.0, scale), err
    print("ok")


if __name__ == "__main__":
    main()
