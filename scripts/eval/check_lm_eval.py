"""lm-evaluation-harness against `attnres serve`, with the same task run by lm-eval's `hf`
backend on the same model loaded by transformers as the oracle.

    pip install -r scripts/reference/requirements.txt
    cargo build --release --bin attnres
    python scripts/eval/check_lm_eval.py --model DIR [--model DIR ...] [--items 200]

For each model directory (a training run of any residual mode, or an imported standard model):
makes the `attnres_next_line` task (scripts/eval/make_task.py), starts `attnres serve` on a free
loopback port, runs `lm_eval --model local-completions` against it (log-likelihoods from the
prompt's log-probabilities: `echo`, `logprobs`, token-id prompts) and `lm_eval --model hf` on the
same directory (`trust_remote_code` for AttnRes), and checks that both give the same accuracy and
every choice's log-likelihood within LOGLIK_TOL. Exits 1 on a mismatch.
"""
import argparse
import glob
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LOGLIK_TOL = 1e-3
TASK = "attnres_next_line"


def log(msg):
    print(msg, flush=True)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lm_eval(args, backend, model_args, task_dir, out):
    cmd = [os.path.join(os.path.dirname(sys.executable), "lm_eval"), "--model", backend,
           "--model_args", model_args, "--tasks", TASK, "--include_path", task_dir,
           "--batch_size", "1", "--log_samples", "--output_path", out]
    if backend == "hf":
        cmd += ["--device", "cpu"]
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    t = time.time()
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if res.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    results = json.load(open(glob.glob(os.path.join(out, "**", "results_*.json"), recursive=True)[0]))
    samples = [json.loads(line) for f in glob.glob(os.path.join(out, "**", f"samples_{TASK}_*.jsonl"), recursive=True)
               for line in open(f)]
    samples.sort(key=lambda s: s["doc_id"])
    return results["results"][TASK], samples, time.time() - t


def check(args, model, work, task_dir):
    name = os.path.basename(os.path.normpath(model))
    port = free_port()
    server = subprocess.Popen([args.attnres, "serve", "--model", model, "--port", str(port), "--name", name],
                              stderr=subprocess.PIPE, text=True)
    try:
        server.stderr.readline()  # the line that says it listens
        url = f"http://127.0.0.1:{port}/v1/completions"
        served, served_samples, t1 = lm_eval(
            args, "local-completions",
            f"base_url={url},model={name},tokenizer={model},tokenizer_backend=huggingface,"
            "tokenized_requests=True,num_concurrent=1,max_retries=1",
            task_dir, os.path.join(work, f"{name}-served"))
    finally:
        server.terminate()
        server.wait()
    oracle, oracle_samples, t2 = lm_eval(
        args, "hf", f"pretrained={model},trust_remote_code=True,dtype=float32", task_dir,
        os.path.join(work, f"{name}-hf"))
    worst = 0.0
    for a, b in zip(served_samples, oracle_samples, strict=True):
        for (la, _), (lb, _) in zip(a["filtered_resps"], b["filtered_resps"], strict=True):
            worst = max(worst, abs(float(la) - float(lb)))
    acc = (served["acc,none"], oracle["acc,none"])
    ok = acc[0] == acc[1] and worst <= LOGLIK_TOL
    log(f"{'ok  ' if ok else 'FAIL'} {name}: accuracy {acc[0]:.3f} served, {acc[1]:.3f} hf; "
        f"{len(served_samples)} items, largest log-likelihood difference {worst:.2e} (bound {LOGLIK_TOL:g}); "
        f"{t1:.0f} s served, {t2:.0f} s hf")
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--attnres", default=os.path.join(ROOT, "target", "release", "attnres"))
    ap.add_argument("--model", action="append", required=True)
    ap.add_argument("--items", type=int, default=200)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="attnres-lm-eval-") as work:
        task_dir = os.path.join(work, "task")
        subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "eval", "make_task.py"), "--out", task_dir,
                        "--items", str(args.items)], check=True, capture_output=True)
        results = [check(args, m, work, task_dir) for m in args.model]
    if not all(results):
        sys.exit(1)
    log("lm-eval against the server agrees with lm-eval on transformers")


if __name__ == "__main__":
    main()
