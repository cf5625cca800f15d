"""Training a plain PyTorch module next to its carve program: the pieces the
tests of plain exports share (common_ops.py, plain_buffers.py, recurrent.py,
standard_op_rules.py).

A module is exported, compiled with plain SGD (no momentum, no clipping),
trained STEPS steps on the same samples in the same order, and compared:
every step's loss, then the final weights of the checkpoint against the
module's state_dict.

A comparison over several steps means something only where float32 itself is
well posed: before comparing, train_like_torch trains a float64 copy of the
module on the same batches and fails, saying so, when PyTorch's own float32
run is farther from it than the tolerances allow carve to be."""

import copy
import json
import os

import numpy as np

import st
import harness  # noqa: E402

TIMEOUT_S = 300
# Weight gaps are relative to a tensor's largest entry, but never to less than
# this: a parameter whose gradient is zero in exact arithmetic (the bias of a
# batch norm whose output feeds only a convolution and another batch norm,
# which subtracts any shift; a key bias under softmax) stays at its initial
# zero plus float32 rounding noise on both sides (~1e-9), and is compared to
# within WEIGHT_FLOOR * rtol absolute, as everything below the floor is.
WEIGHT_FLOOR = 1e-3


Failure = harness.Failure


def run(cmd, env=None):
    """Runs `cmd`; its stdout and stderr, or Failure naming it."""
    return harness.run_ok(cmd, timeout=TIMEOUT_S, env=env, tail=3000).text


def sgd_losses(net, batches, lr):
    """PyTorch's losses of plain SGD over `batches` (tuples of numpy arrays,
    the module's inputs in order); `net` is trained in place."""
    import torch
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    losses = []
    for batch in batches:
        opt.zero_grad()
        loss = net(*(torch.from_numpy(a) for a in batch))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def token_file(path, tokens, batch, seq, steps):
    """Writes `tokens` (int32) to `path`, a flat token file, and returns the
    (inputs, targets) int64 windows of `steps` global batches as carve reads
    it the default (wrapped) way (docs/data.md): sequence j of step k starts
    at ((k*B + j) * T) mod (N - T - 1), its targets one token later."""
    tokens = np.asarray(tokens, dtype=np.int32)
    tokens.tofile(path)
    starts = [((k * batch + j) * seq) % (len(tokens) - seq - 1) for k in range(steps)
              for j in range(batch)]
    windows = np.stack([tokens[o:o + seq + 1] for o in starts]).astype(np.int64)
    return windows[:, :seq].copy(), windows[:, 1:].copy()


def verify_plans(carve, label, onnx_path, data, plans, workdir, steps=3):
    """`carve verify` of each (name, plan) against 1 rank; Failure unless it
    passes. Prints one line per plan."""
    for name, plan in plans:
        pj = os.path.join(workdir, name + ".json")
        with open(pj, "w") as f:
            json.dump(plan, f)
        text = run([carve, "verify", onnx_path, "--plan", pj, "--steps", str(steps), "--data",
                    data, "--workdir", os.path.join(workdir, "verify-" + name)])
        if "PASS" not in text:
            raise Failure("%s %s: carve verify did not pass:\n%s" % (label, name, text))
        print("ok: %s %s: %s" % (label, name, text.strip().splitlines()[-1]))


def well_posed_reference(net, batches, lr):
    """A float64 copy of `net` (before it trains) trained by plain SGD on
    `batches` (float inputs widened): (the trained copy, its losses)."""
    exact = copy.deepcopy(net).double()
    wide = [tuple(a.astype(np.float64) if a.dtype.kind == "f" else a for a in b)
            for b in batches]
    try:
        losses = sgd_losses(exact, wide, lr)
    except RuntimeError as e:
        raise Failure("cannot check that the comparison is well posed: the module does not "
                      "train in float64 (%s); make its constants follow the input's dtype"
                      % str(e).splitlines()[0])
    return exact, losses


def check_well_posed(net, ref, exact, exact_losses, loss_rtol, weight_rtol):
    """Failure when PyTorch's float32 run (`net`, losses `ref`) is farther from
    its float64 run than the tolerances carve is held to: such a setting tests
    rounding, not carve (choose the batch, the learning rate or the steps so
    that it is well posed)."""
    gap = max(abs(a - b) / abs(b) for a, b in zip(ref, exact_losses))
    if gap > loss_rtol:
        raise Failure("not well posed in float32: PyTorch's own float32 losses are %.3g from "
                      "its float64 run's (the test allows carve %g)" % (gap, loss_rtol))
    wide = dict(exact.state_dict())
    for name, p in net.state_dict().items():
        if not p.is_floating_point():
            continue
        t = wide[name].detach().numpy()
        g = float(np.max(np.abs(p.detach().numpy() - t)) / max(np.max(np.abs(t)), WEIGHT_FLOOR))
        if g > weight_rtol:
            raise Failure("not well posed in float32: PyTorch's own float32 %s is %.3g (of its "
                          "largest entry) from its float64 run's (the test allows carve %g)"
                          % (name, g, weight_rtol))


def read_losses(log):
    return [json.loads(line)["loss"] for line in open(log)]


def worst_loss_gap(label, mine, ref, rtol):
    """The largest relative loss difference; Failure above `rtol` or when a
    step is missing."""
    worst = max(abs(m - r) / abs(r) for m, r in zip(mine, ref))
    if len(mine) != len(ref) or worst > rtol:
        raise Failure("%s: losses differ from PyTorch's by %.3g (limit %g)\n  carve   %s\n"
                      "  PyTorch %s" % (label, worst, rtol, mine, ref))
    return worst


def train_like_torch(carve, onnx_path, net, data, xs, ys, out, batch, steps, lr, loss_rtol,
                     weight_rtol, flags=(), require_all=True):
    """Compiles `onnx_path` for 1 rank with plain SGD at `lr` (no clipping;
    `flags` added to carve compile), trains it `steps` steps on `data` (whose
    samples are `xs`, `ys`, `batch` a step), trains `net` on the same
    batches, and compares them (Failure beyond `loss_rtol` / `weight_rtol`):
    (carve's losses, worst loss gap, worst weight gap, its tensor, tensors
    compared)."""
    run([carve, "compile", onnx_path, *flags, "-o", out, "--quiet", "--optimizer", "sgd", "--lr",
         str(lr), "--clip-grad-norm", "0"])
    log, ckpt = out + ".jsonl", out + ".ckpt"
    run([carve, "run", out, "-n", "1", "--", "--steps", str(steps), "--data", data, "--log",
         log, "--save", ckpt, "--progress", "none"])
    batches = [(xs[k * batch:(k + 1) * batch], ys[k * batch:(k + 1) * batch])
               for k in range(steps)]
    losses = read_losses(log)
    exact, exact_losses = well_posed_reference(net, batches, lr)
    ref = sgd_losses(net, batches, lr)
    check_well_posed(net, ref, exact, exact_losses, loss_rtol, weight_rtol)
    worst = worst_loss_gap("1 rank", losses, ref, loss_rtol)
    gap, where, compared = worst_weight_gap("1 rank", ckpt, net, weight_rtol,
                                            require_all=require_all)
    return losses, worst, gap, where, compared


def worst_weight_gap(label, ckpt, net, rtol, skip=(), require_all=True):
    """The largest difference of a checkpoint tensor from the module's, as a
    fraction of the module tensor's largest entry, and its name; Failure above
    `rtol`. Tensors in `skip` are not compared; with `require_all` every
    other one of the module must be in the checkpoint."""
    mine = st.load_checkpoint(ckpt)
    gap, where, compared = 0.0, "", 0
    for name, p in net.state_dict().items():
        if name in skip:
            continue
        if name not in mine:
            if require_all:
                raise Failure("%s: the checkpoint has no %s (it has %s)"
                              % (label, name, sorted(mine)))
            continue
        t = p.detach().numpy()
        g = float(np.max(np.abs(mine[name] - t)) / max(np.max(np.abs(t)), WEIGHT_FLOOR))
        compared += 1
        if g > gap:
            gap, where = g, name
    if gap > rtol:
        raise Failure("%s: final weights of %s differ from PyTorch's by %.3g of the largest "
                      "entry (limit %g)" % (label, where, gap, rtol))
    return gap, where, compared
