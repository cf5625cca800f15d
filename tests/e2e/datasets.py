#!/usr/bin/env python3
"""Data sets and evaluation (docs/data.md), end to end.

What must hold:

1. Token data as two files named by a glob, cut into documents at an
   end-of-text id (--doc-eot) and shuffled per epoch (--shuffle): the rows
   `train --check-data --show-batches` prints are those the Python formulas
   of docs/data.md give (documents, windows, shuffle_index), the same under
   1 rank, dp2, tp2, pp2 (2 micro-batches) and dp2 ZeRO-3 (whose evaluation
   gathers the parameters as the forward does); each epoch reads each window
   at most once.
2. Training on that data under those plans gives the 1-rank losses (within
   LOSS_RTOL), and so does the evaluation (--eval-data, --eval-every).
3. Evaluation changes nothing: the training losses of a run with it are
   bitwise those of the same run without it.
4. The evaluation loss is PyTorch's mean loss of the same weights (the
   run's final checkpoint, merged, read by docs/data.md's numpy-only
   read_safetensors and loaded strictly) on the same windows, within
   TORCH_RTOL; perplexity is its exp; the accuracy is the share of targets
   PyTorch's argmax of the logits gives, exactly, under every plan (tp2
   computes it from vocab-parallel logits no rank holds whole).
5. A run resumed mid-epoch from a checkpoint equals the unbroken run
   bitwise under every plan above, and the log's "epoch" field counts epochs.
6. A sample-major tensor data set written by docs/data.md's own numpy
   writer trains the MLP with --shuffle: the rows are shuffle_index's, the
   losses of dp2 equal 1 rank's, and its evaluation equals PyTorch's.
7. Bad input (a glob that matches nothing, an evaluation set smaller than one
   batch, more --eval-batches than it holds, --shuffle on batch-major
   tensors, unordered --doc-offsets, --eval-every without --eval-data, a bad
   seed): one line naming the cause, exit 1, no log written.

Tolerances: the plans differ from 1 rank only in the order of float32 sums
(parallel.py measures 2e-7 relative on these models); LOSS_RTOL = 1e-5, as
parallel.py. PyTorch computes the same float32 forward with its own kernels:
TORCH_RTOL = 1e-5, as checkpoint.py.
"""

import argparse
import json
import math
import os
import re
import shutil
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import data_gen  # noqa: E402
import st  # noqa: E402
import harness  # noqa: E402

LOSS_RTOL = 1e-5
TORCH_RTOL = 1e-5
TIMEOUT_S = 300
SGD = ["--optimizer", "sgd", "--lr", "0.05", "--momentum", "0.9"]
PLANS = [("1rank", {}, 1), ("dp2", {"dp": 2}, 2), ("tp2", {"tp": 2}, 2),
         ("pp2", {"pp": 2, "num_micro_batches": 2}, 2), ("dp2-zero3", {"dp": 2, "zero": 3}, 2)]
STEPS = 8
SEED = 7


Failure = harness.Failure


def run(cmd, ok=True):
    if ok:
        return harness.run_ok(cmd, timeout=TIMEOUT_S, tail=None)
    return harness.run(cmd, timeout=TIMEOUT_S)


def doc_code(marker):
    """The ```python block of docs/data.md that defines `marker`, executed."""
    text = open(os.path.join(ROOT, "docs", "data.md")).read()
    for block in re.findall(r"```python\n(.*?)```", text, re.S):
        if "def " + marker in block:
            scope = {}
            exec(block, scope)  # noqa: S102 - the documentation's own code
            return scope[marker]
    raise Failure("docs/data.md has no python block defining %s" % marker)


shuffle_index = doc_code("shuffle_index")
write_samples = doc_code("write_samples")
read_safetensors = doc_code("read_safetensors")


def windows(files, seq, eot=None):
    """docs/data.md's windows: [(file, offset in file)] in stream order."""
    out = []
    for path in files:
        tokens = data_gen.read_tokens(path)
        starts = [0] + ([i + 1 for i, t in enumerate(tokens[:-1]) if t == eot]
                        if eot is not None else [])
        ends = starts[1:] + [len(tokens)]
        for s, e in zip(starts, ends):
            out += [(path, s + w * seq) for w in range((e - s - 1) // seq)]
    return out


def row_item(k, j, items, batch, seed):
    steps = items // batch
    epoch, pos = divmod(k, steps)
    pos = pos * batch + j
    return shuffle_index(pos, items, seed, epoch) if seed is not None else pos


def compile_(carve, onnx, plan, out):
    with open(out + ".plan.json", "w") as f:
        json.dump(plan, f)
    run([carve, "compile", onnx, "--plan", out + ".plan.json", "-o", out, "--quiet"] + SGD)


def train(carve, out, ranks, args, log):
    if os.path.exists(log):
        os.remove(log)
    p = run([carve, "run", out, "-n", str(ranks), "--", "--log", log, "--progress", "none"] +
            args)
    records = [json.loads(l) for l in open(log)]
    steps = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    return steps, evals, p.stdout


def close(a, b, rtol):
    return abs(a - b) <= rtol * max(abs(a), abs(b))


def shown_rows(stdout):
    return re.findall(r"carve: step (\d+) row (\d+): (.*)", stdout)


def torch_eval(carve, onnx, name, ck, batches, w, head):
    """PyTorch's mean loss of the checkpoint's weights over `batches`, and the
    share of targets that are the argmax of the logits (the module `head`'s
    output, which feeds the cross-entropy)."""
    import torch
    import torch_ref
    merged = os.path.join(w, name + "-merged.safetensors")
    run([carve, "ckpt", "merge", ck, "-o", merged, "--model", onnx])
    module, _ = torch_ref.build_model(onnx, name)
    module.load_state_dict({k: torch.from_numpy(v) for k, v in
                            read_safetensors(merged).items()}, strict=True)
    losses, right, counted = [], 0, 0
    seen = []
    getattr(module, head).register_forward_hook(lambda m, i, o: seen.append(o))
    with torch.no_grad():
        for batch in batches:
            seen.clear()
            losses.append(float(module(*[torch.from_numpy(np.asarray(x)) for x in batch])))
            logits = seen[0].reshape(-1, seen[0].shape[-1])
            targets = torch.from_numpy(np.asarray(batch[-1])).reshape(-1)
            right += int((logits.argmax(-1) == targets).sum())
            counted += targets.numel()
    return sum(losses) / len(losses), right / counted


def check_tokens(carve, models, w):
    onnx = os.path.join(models, "opset17", "gpt.onnx")
    vocab = data_gen.vocab_size(onnx)
    batch, seq = data_gen.graph_inputs(onnx)[0][2]
    tokens = data_gen.make_tokens(400, vocab, seed=5)
    counts = np.bincount(tokens, minlength=vocab)
    eot = int(np.argmin(np.abs(counts - len(tokens) / 40)))  # documents of ~40 tokens
    os.makedirs(os.path.join(w, "shards"))
    files = [os.path.join(w, "shards", "part-%d.bin" % i) for i in range(2)]
    data_gen.write_tokens(files[0], tokens[:220])
    data_gen.write_tokens(files[1], tokens[220:])
    eval_file = os.path.join(w, "eval.bin")
    data_gen.write_tokens(eval_file, data_gen.make_tokens(400, vocab, seed=6))
    data = ["--data", os.path.join(w, "shards", "part-*.bin"), "--doc-eot", str(eot),
            "--shuffle", str(SEED)]
    evald = ["--eval-data", eval_file, "--eval-every", "4", "--eval-batches", "3"]

    # 1. The rows, by the documentation's formulas, under every plan.
    wins = windows(files, seq, eot)
    steps_per_epoch = len(wins) // batch
    if not 2 <= steps_per_epoch < STEPS:
        raise Failure("the test data gives %d steps per epoch; it needs 2 to %d" % (
            steps_per_epoch, STEPS - 1))
    # --show-batches numbers steps from 1, as the log does; the formulas' k is that minus 1.
    want = [(str(k + 1), str(j), "%s token %d" % wins[row_item(k, j, len(wins), batch, SEED)])
            for k in range(STEPS) for j in range(batch)]
    outs = {}
    for name, plan, ranks in PLANS:
        out = os.path.join(w, "gpt-" + name)
        compile_(carve, onnx, plan, out)
        outs[name] = out
        p = run([carve, "run", out, "-n", str(ranks), "--", "--check-data", "--show-batches",
                 str(STEPS)] + data + evald)
        got = shown_rows(p.stdout)
        if got != want:
            raise Failure("%s: --show-batches rows differ from docs/data.md's formulas:\n"
                          "got  %s\nwant %s" % (name, got[:8], want[:8]))
    for e in range(STEPS // steps_per_epoch):
        seen = [r[2] for r in want[e * steps_per_epoch * batch:(e + 1) * steps_per_epoch * batch]]
        if len(set(seen)) != len(seen):
            raise Failure("epoch %d reads a window twice: %s" % (e, seen))
    print("ok: %d windows of %d tokens from %d tokens in documents ended by id %d over 2 files, "
          "%d steps per epoch: --show-batches equals docs/data.md's formulas under %s" % (
              len(wins), seq + 1, len(tokens), eot, steps_per_epoch,
              ", ".join(p[0] for p in PLANS)))

    # 2. Every plan trains and evaluates as 1 rank does.
    ck = os.path.join(w, "gpt-ck")
    base_steps, base_evals, so = train(carve, outs["1rank"], 1,
                                       ["--steps", str(STEPS), "--save", ck] + data + evald,
                                       os.path.join(w, "gpt-1rank.jsonl"))
    if [r["step"] for r in base_evals] != [4, 8] or any(r["eval_batches"] != 3
                                                        for r in base_evals):
        raise Failure("--eval-every 4 over %d steps logged evaluations %s" % (STEPS, base_evals))
    if "eval loss" not in so:
        raise Failure("the progress output names no evaluation:\n%s" % so)
    for r in base_evals:
        if not close(r["eval_ppl"], math.exp(r["eval_loss"]), 1e-6):
            raise Failure("eval_ppl %r is not exp(eval_loss %r)" % (r["eval_ppl"],
                                                                    r["eval_loss"]))
    if [r.get("epoch") for r in base_steps] != [k // steps_per_epoch for k in range(STEPS)]:
        raise Failure("the log's epochs are %s" % [r.get("epoch") for r in base_steps])
    for name, plan, ranks in PLANS[1:]:
        steps, evals, _ = train(carve, outs[name], ranks, ["--steps", str(STEPS)] + data + evald,
                                os.path.join(w, "gpt-%s.jsonl" % name))
        pairs = [(a["loss"], b["loss"]) for a, b in zip(steps, base_steps)] + \
                [(a["eval_loss"], b["eval_loss"]) for a, b in zip(evals, base_evals)]
        if len(pairs) != STEPS + 2 or not all(close(a, b, LOSS_RTOL) for a, b in pairs):
            raise Failure("%s: losses and evaluations %s differ from 1 rank's beyond %g" % (
                name, pairs, LOSS_RTOL))
        accs = [(a.get("eval_accuracy"), b.get("eval_accuracy")) for a, b in zip(evals,
                                                                                 base_evals)]
        if any(a != b or a is None for a, b in accs):
            raise Failure("%s: evaluation accuracies %s differ from 1 rank's" % (name, accs))
        worst = max(abs(a - b) / abs(b) for a, b in pairs)
        print("ok: %s: %d shuffled training losses and %d evaluations equal 1 rank's "
              "(worst %.2g relative)" % (name, STEPS, len(evals), worst))

    # 3. Evaluation changes nothing.
    plain, _, _ = train(carve, outs["1rank"], 1, ["--steps", str(STEPS)] + data,
                        os.path.join(w, "gpt-noeval.jsonl"))
    if [r["loss"] for r in plain] != [r["loss"] for r in base_steps]:
        raise Failure("training with --eval-data changed the losses: %s vs %s" % (
            [r["loss"] for r in base_steps], [r["loss"] for r in plain]))
    print("ok: evaluating every 4 steps leaves every training loss bitwise as it was")

    # 4. The evaluation equals PyTorch's on the same weights and windows.
    import torch_ref  # noqa: F401  (needs torch: checked here, not at import)
    ewins = windows([eval_file], seq, eot)
    batches = []
    ev = data_gen.read_tokens(eval_file)
    for b in range(3):
        rows = [ev[o:o + seq + 1] for _, o in ewins[b * batch:(b + 1) * batch]]
        batches.append((np.stack([r[:-1] for r in rows]), np.stack([r[1:] for r in rows])))
    ref, ref_acc = torch_eval(carve, onnx, "gpt", ck, batches, w, "lm_head")
    got, acc = base_evals[-1]["eval_loss"], base_evals[-1].get("eval_accuracy")
    if not close(ref, got, TORCH_RTOL):
        raise Failure("eval loss %r, PyTorch's on the same weights and windows %r" % (got, ref))
    if acc is None or abs(acc - ref_acc) > 1e-8:  # the log's 9 digits
        raise Failure("eval accuracy %r, PyTorch's argmax on the same logits %r" % (acc, ref_acc))
    print("ok: eval loss %.8g equals PyTorch's %.8g on the same 3 batches (%.2g relative); "
          "accuracy %.4f equals PyTorch's argmax" % (got, ref, abs(got - ref) / abs(ref), acc))

    # 5. Resume mid-epoch, bitwise.
    for name, _, ranks in PLANS:
        mid = 1 + steps_per_epoch  # step 1 of epoch 1
        ckm = os.path.join(w, "gpt-mid-" + name)
        full, _, _ = train(carve, outs[name], ranks, ["--steps", str(STEPS)] + data,
                           os.path.join(w, "gpt-full-%s.jsonl" % name))
        train(carve, outs[name], ranks, ["--steps", str(mid), "--save", ckm] + data,
              os.path.join(w, "gpt-first-%s.jsonl" % name))
        rest, _, _ = train(carve, outs[name], ranks,
                           ["--steps", str(STEPS - mid), "--load", ckm] + data,
                           os.path.join(w, "gpt-rest-%s.jsonl" % name))
        key = [(r["step"], r["loss"], r.get("epoch")) for r in full[mid:]]
        if [(r["step"], r["loss"], r.get("epoch")) for r in rest] != key:
            raise Failure("%s: resumed at step %d (mid-epoch): %s, the unbroken run %s" % (
                name, mid, rest, full[mid:]))
        print("ok: %s: resumed at step %d, in the middle of epoch 1, equals the unbroken run "
              "bitwise" % (name, mid))


def check_samples(carve, models, w):
    onnx = os.path.join(models, "opset17", "mlp.onnx")
    inputs = data_gen.graph_inputs(onnx)
    batch = inputs[0][2][0]
    per = data_gen.make_tensors(inputs, 9, data_gen.class_counts("mlp"), seed=2)
    samples = {k: v.reshape((-1,) + v.shape[2:]) for k, v in per.items()}  # [36, ...]
    train_path = os.path.join(w, "mlp-train.safetensors")
    eval_path = os.path.join(w, "mlp-eval.safetensors")
    write_samples(train_path, {k: v[:26] for k, v in samples.items()})  # 6 steps per epoch
    write_samples(eval_path, {k: v[26:] for k, v in samples.items()})  # 2 batches
    data = ["--data", train_path, "--shuffle", "3", "--eval-data", eval_path]
    outs = {}
    for name, plan, ranks in PLANS[:2]:
        out = os.path.join(w, "mlp-" + name)
        compile_(carve, onnx, plan, out)
        outs[name] = out
        p = run([carve, "run", out, "-n", str(ranks), "--", "--check-data", "--show-batches",
                 "8"] + data)
        want = [(str(k + 1), str(j), "%s sample %d" % (train_path, row_item(k, j, 26, batch, 3)))
                for k in range(8) for j in range(batch)]
        if shown_rows(p.stdout) != want:
            raise Failure("mlp %s: --show-batches %s, expected %s" % (
                name, shown_rows(p.stdout)[:8], want[:8]))
    ck = os.path.join(w, "mlp-ck")
    base, base_ev, _ = train(carve, outs["1rank"], 1, ["--steps", "8", "--save", ck] + data,
                             os.path.join(w, "mlp-1rank.jsonl"))
    dp, dp_ev, _ = train(carve, outs["dp2"], 2, ["--steps", "8"] + data,
                         os.path.join(w, "mlp-dp2.jsonl"))
    pairs = [(a["loss"], b["loss"]) for a, b in zip(dp, base)] + \
            [(a["eval_loss"], b["eval_loss"]) for a, b in zip(dp_ev, base_ev)]
    if len(pairs) != 9 or not all(close(a, b, LOSS_RTOL) for a, b in pairs):
        raise Failure("mlp dp2: %s differ from 1 rank's" % pairs)
    ev = {k: v[26:] for k, v in samples.items()}
    batches = [tuple(ev[n][b * batch:(b + 1) * batch] for n, _, _ in inputs) for b in range(2)]
    ref, ref_acc = torch_eval(carve, onnx, "mlp", ck, batches, w, "head")
    if not close(ref, base_ev[-1]["eval_loss"], TORCH_RTOL) or "eval_samples" not in base_ev[-1] \
            or abs(base_ev[-1].get("eval_accuracy", -1) - ref_acc) > 1e-8 \
            or dp_ev[-1].get("eval_accuracy") != base_ev[-1].get("eval_accuracy"):
        raise Failure("mlp: evaluation %s (dp2 %s), PyTorch's loss %r, accuracy %r" % (
            base_ev[-1], dp_ev[-1], ref, ref_acc))
    print("ok: sample-major data from docs/data.md's writer: shuffled rows as documented, dp2 "
          "equals 1 rank, eval loss %.8g equals PyTorch's %.8g" % (base_ev[-1]["eval_loss"], ref))
    return outs["1rank"]


def check_bad(carve, w, mlp):
    gpt = os.path.join(w, "gpt-1rank")
    tiny = os.path.join(w, "tiny.bin")
    data_gen.write_tokens(tiny, np.arange(40) % 8)
    good = os.path.join(w, "eval.bin")
    offsets = os.path.join(w, "offsets.bin")
    np.array([0, 200, 100], "<i8").tofile(offsets)
    # What a newcomer's np.array(ids).tofile() writes: int64 ids.
    wide = os.path.join(w, "eval-int64.bin")
    np.array(np.fromfile(good, "<i4").tolist()).tofile(wide)
    batch_major = os.path.join(w, "mlp-batches.safetensors")
    st.save(batch_major, {"x": np.zeros((2, 4, 32), np.float32),
                          "targets": np.zeros((2, 4), np.int64)})
    # A newcomer's labels with one class too many: sample 5 names class 10 of the MLP's 10.
    labels = np.arange(12) % 10
    labels[5] = 10
    bad_labels = os.path.join(w, "mlp-bad-labels.safetensors")
    st.save(bad_labels, {"x": np.zeros((12, 32), np.float32), "targets": labels})
    cases = [
        (gpt, ["--data", os.path.join(w, "nothing-*.bin")],
         "--data: no file matches '%s'" % os.path.join(w, "nothing-*.bin")),
        (gpt, ["--data", good, "--eval-data", tiny],
         "token file %s: 2 windows of 17 tokens (40 tokens in 1 document) is fewer than one "
         "global batch of 4 sequences" % tiny),
        (gpt, ["--data", good, "--eval-data", good, "--eval-batches", "99"],
         "--eval-batches 99: the evaluation set"),
        (mlp, ["--data", batch_major, "--shuffle", "1"],
         "batch-major tensors [S, B, ...] are never shuffled"),
        (gpt, ["--data", good, "--doc-offsets", offsets],
         "offset 2 (0-based) is 100; offsets must increase strictly"),
        (gpt, ["--data", good, "--eval-every", "2"],
         "--eval-every needs --eval-data FILES (the held-out set)"),
        (gpt, ["--data", good, "--shuffle", "x"],
         "--shuffle needs a seed, an integer >= 0, not 'x'"),
        (gpt, ["--data", wide],
         "token file %s: every second int32 token is 0, as when int64 ids are read as int32 "
         "(numpy's tofile() writes int64 unless the array is converted); pass --data-dtype "
         "int64" % wide),
        (gpt, ["--data", wide, "--check-data"], "pass --data-dtype int64"),
        (mlp, ["--data", bad_labels],
         "data file %s: tensor 'targets' sample 5: target 10 is outside the model's 10 classes "
         "(0 to 9, or the ignore index -100)" % bad_labels),
        (mlp, ["--data", os.path.join(w, "mlp-train.safetensors"), "--eval-data", bad_labels],
         "data file %s: tensor 'targets' sample 5: target 10" % bad_labels),
        (gpt, ["--data", batch_major],
         "token file %s: this is a safetensors file (tensor data), but the model reads flat "
         "token files" % batch_major),
    ]
    for out, args, message in cases:
        log = os.path.join(w, "bad.jsonl")
        if os.path.exists(log):
            os.remove(log)
        p = run([carve, "run", out, "-n", "1", "--", "--steps", "2", "--log", log] + args,
                ok=False)
        errors = [l for l in p.stderr.splitlines() if "error" in l]
        if p.returncode != 1 or len(errors) != 1 or message not in errors[0] \
                or os.path.exists(log):
            raise Failure("%s: expected exit 1, one error line with %r and no log; got exit %d, "
                          "log %s:\n%s%s" % (args, message, p.returncode, os.path.exists(log),
                                             p.stdout, p.stderr))
        print("ok: bad input %s: %s" % (" ".join(args[2:] or args), errors[0].strip()))
    # Under dp = 2 too: one line, from the start-up check, not a kernel's abort mid-run.
    p = run([carve, "run", os.path.join(w, "mlp-dp2"), "-n", "2", "--", "--steps", "2",
             "--data", bad_labels], ok=False)
    errors = [l for l in p.stderr.splitlines() if "error" in l]
    if p.returncode != 1 or len(errors) != 1 or "sample 5: target 10 is outside" not in errors[0] \
            or "MPI" in p.stderr or "abort" in p.stderr.lower():
        raise Failure("dp2, a label outside the classes: expected exit 1 and one error line; got "
                      "exit %d:\n%s" % (p.returncode, p.stderr))
    print("ok: bad labels under dp=2: %s" % errors[0].strip())
    # The same ids as int64, read as such: the int32 file's losses, bit for bit.
    runs = []
    for args in (["--data", good], ["--data", wide, "--data-dtype", "int64"]):
        steps, _, _ = train(carve, gpt, 1, ["--steps", "2"] + args, os.path.join(w, "width.jsonl"))
        runs.append([r["loss"] for r in steps])
    if runs[0] != runs[1] or len(runs[0]) != 2:
        raise Failure("--data-dtype int64: losses %s, the int32 file's %s" % (runs[1], runs[0]))
    print("ok: --data-dtype int64: the int32 file's losses, bitwise (%s)" % runs[1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--carve", required=True)
    ap.add_argument("--models", required=True)
    ap.add_argument("--workdir", required=True)
    a = ap.parse_args()
    shutil.rmtree(a.workdir, ignore_errors=True)
    os.makedirs(a.workdir)
    try:
        check_tokens(a.carve, a.models, a.workdir)
        mlp = check_samples(a.carve, a.models, a.workdir)
        check_bad(a.carve, a.workdir, mlp)
    except Failure as e:
        print("FAIL: %s" % e)
        return 1
    print("datasets: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
