#!/usr/bin/env python3
"""Logs and plots: `train --tensorboard DIR` and `carve plot`.

What must hold (docs/training.md#logs-and-plots), on the GPT-style reference
model under 1 rank, dp=2, tp=2 and pp=2 with 2 micro-batches:

1. `train --tensorboard DIR` writes one event file that the public record
   format reads: TFRecord framing with valid masked CRC-32C checksums (checked
   by this test's own CRC), tensorflow.Event messages decoded by the protobuf
   library from a descriptor built here (file_version "brain.Event:2" first,
   then one event per step), and scalars loss, lr, grad_norm equal to the
   JSONL log's values in float32 and tokens_per_s within 1e-6 (the log
   prints that double in 9 digits).
2. `carve plot` of the four logs writes an SVG (well-formed XML) with one
   panel per series (loss, lr, grad_norm, throughput), one polyline per run
   in each, one point per step, and a legend naming each log.
3. Bad input: a log that is not JSON Lines, a missing log, no -o; a
   --tensorboard path that is a file: one line naming it, exit 1, nothing
   written.
"""

import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import xml.etree.ElementTree as ET
import harness  # noqa: E402

STEPS = 6
TIMEOUT_S = 300
PLANS = [("1rank", {}, 1), ("dp2", {"dp": 2}, 2), ("tp2", {"tp": 2}, 2),
         ("pp2", {"pp": 2, "num_micro_batches": 2}, 2)]


Failure = harness.Failure


def run(cmd):
    return harness.run(cmd, timeout=TIMEOUT_S)


def crc32c(data):
    crc = 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
    return crc ^ 0xFFFFFFFF


def masked(data):
    c = crc32c(data)
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def event_class():
    """tensorflow.Event, Summary and Summary.Value (the fields carve writes),
    from a descriptor built here: the protobuf library decodes the records."""
    from google.protobuf import descriptor_pb2, descriptor_pool
    try:
        from google.protobuf import message_factory
        get = message_factory.GetMessageClass
    except (ImportError, AttributeError):
        from google.protobuf import reflection  # noqa: F401
        get = None
    f = descriptor_pb2.FileDescriptorProto(name="carve_test_event.proto", package="tensorflow",
                                           syntax="proto3")
    T = descriptor_pb2.FieldDescriptorProto
    value = f.message_type.add(name="Value")
    value.field.add(name="tag", number=1, type=T.TYPE_STRING, label=T.LABEL_OPTIONAL)
    value.field.add(name="simple_value", number=2, type=T.TYPE_FLOAT, label=T.LABEL_OPTIONAL)
    summ = f.message_type.add(name="Summary")
    summ.field.add(name="value", number=1, type=T.TYPE_MESSAGE, label=T.LABEL_REPEATED,
                   type_name=".tensorflow.Value")
    ev = f.message_type.add(name="Event")
    ev.field.add(name="wall_time", number=1, type=T.TYPE_DOUBLE, label=T.LABEL_OPTIONAL)
    ev.field.add(name="step", number=2, type=T.TYPE_INT64, label=T.LABEL_OPTIONAL)
    ev.field.add(name="file_version", number=3, type=T.TYPE_STRING, label=T.LABEL_OPTIONAL)
    ev.field.add(name="summary", number=5, type=T.TYPE_MESSAGE, label=T.LABEL_OPTIONAL,
                 type_name=".tensorflow.Summary")
    pool = descriptor_pool.DescriptorPool()
    pool.Add(f)
    desc = pool.FindMessageTypeByName("tensorflow.Event")
    if get:
        return get(desc)
    from google.protobuf import message_factory
    return message_factory.MessageFactory(pool).GetPrototype(desc)


def read_events(path):
    Event = event_class()
    data = open(path, "rb").read()
    at, events = 0, []
    while at < len(data):
        if at + 12 > len(data):
            raise Failure("%s: a truncated record header at byte %d" % (path, at))
        (n,) = struct.unpack_from("<Q", data, at)
        (lcrc,) = struct.unpack_from("<I", data, at + 8)
        if lcrc != masked(data[at:at + 8]):
            raise Failure("%s: bad length checksum at byte %d" % (path, at))
        body = data[at + 12:at + 12 + n]
        (dcrc,) = struct.unpack_from("<I", data, at + 12 + n)
        if dcrc != masked(body):
            raise Failure("%s: bad data checksum at byte %d" % (path, at))
        e = Event()
        e.ParseFromString(body)
        events.append(e)
        at += 12 + n + 4
    return events


def f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--carve", required=True)
    ap.add_argument("--models", required=True)
    ap.add_argument("--workdir", required=True)
    a = ap.parse_args()
    shutil.rmtree(a.workdir, ignore_errors=True)
    os.makedirs(a.workdir)
    w = a.workdir
    onnx = os.path.join(a.models, "opset17", "gpt.onnx")
    data = os.path.join(w, "gpt.tokens")
    subprocess.run([sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                 "data_gen.py"),
                    "tokens", "--model", onnx, "--tokens", "8192", data], check=True,
                   stdout=subprocess.DEVNULL)

    # 1. TensorBoard event files under every kind of plan.
    logs = []
    for name, plan, ranks in PLANS:
        out = os.path.join(w, "gpt-" + name)
        pj = out + ".plan.json"
        with open(pj, "w") as f:
            json.dump(plan, f)
        rc, so, se = run([a.carve, "compile", onnx, "--plan", pj, "-o", out, "--quiet",
                          "--warmup-steps", "3"])
        if rc != 0:
            raise Failure("compile %s failed:\n%s%s" % (plan, so, se))
        log = os.path.join(w, name + ".jsonl")
        tb = os.path.join(w, "tb-" + name)
        rc, so, se = run([a.carve, "run", out, "-n", str(ranks), "--", "--steps", str(STEPS),
                          "--data", data, "--log", log, "--tensorboard", tb, "--progress",
                          "none"])
        if rc != 0:
            raise Failure("run %s failed:\n%s%s" % (name, so, se))
        logs.append(log)
        files = [f for f in os.listdir(tb) if f.startswith("events.out.tfevents.")]
        if len(files) != 1:
            raise Failure("%s: expected one event file in %s, found %s" % (name, tb, files))
        events = read_events(os.path.join(tb, files[0]))
        if not events or events[0].file_version != "brain.Event:2":
            raise Failure("%s: the first event is not the file version: %s" % (name, events[:1]))
        rows = [json.loads(l) for l in open(log)]
        if len(events) != 1 + len(rows):
            raise Failure("%s: %d events for %d logged steps" % (name, len(events) - 1, len(rows)))
        for e, r in zip(events[1:], rows):
            got = {v.tag: v.simple_value for v in e.summary.value}
            # loss, lr and grad_norm are floats the log prints in 9 digits
            # (exact); the throughput is a double there, rounded to float here.
            want = {k: f32(r[k]) for k in ("loss", "lr", "grad_norm", "tokens_per_s")}
            close = set(got) == set(want) and all(
                got[k] == want[k] if k != "tokens_per_s" else
                abs(got[k] - want[k]) <= 1e-6 * abs(want[k]) for k in want)
            if e.step != r["step"] or not close:
                raise Failure("%s: event of step %d holds %s, the log %s" % (name, e.step, got,
                                                                           want))
        print("ok: %s: %s holds %d step events equal to the JSONL log (CRCs valid)" %
              (name, files[0].split(".")[0] + ".out.tfevents...", len(events) - 1))

    # 2. carve plot.
    svg = os.path.join(w, "curves.svg")
    rc, so, se = run([a.carve, "plot"] + logs + ["-o", svg])
    if rc != 0:
        raise Failure("carve plot failed:\n%s%s" % (so, se))
    root = ET.parse(svg).getroot()
    ns = "{http://www.w3.org/2000/svg}"
    panels = [g.get("data-series") for g in root.iter(ns + "g") if g.get("class") == "panel"]
    if panels != ["loss", "lr", "grad_norm", "throughput"]:
        raise Failure("curves.svg has panels %s" % panels)
    lines = [p for p in root.iter(ns + "polyline") if p.get("class") == "series"]
    for series in panels:
        mine = [p for p in lines if p.get("data-series") == series]
        runs = sorted(p.get("data-run") for p in mine)
        if runs != sorted(os.path.basename(l) for l in logs):
            raise Failure("panel %s draws runs %s" % (series, runs))
        for p in mine:
            if len(p.get("points").split()) != STEPS:
                raise Failure("panel %s, run %s: %d points for %d steps" % (
                    series, p.get("data-run"), len(p.get("points").split()), STEPS))
    legend = [t.text for g in root.iter(ns + "g") if g.get("class") == "legend"
              for t in g.iter(ns + "text")]
    if sorted(legend) != sorted(os.path.basename(l) for l in logs):
        raise Failure("the legend names %s" % legend)
    print("ok: carve plot: %d panels x %d runs, %d points each, legend %s" % (
        len(panels), len(logs), STEPS, ", ".join(legend)))

    # A sparse series (evaluation every 5 steps, as train --eval-every writes it) gets a
    # marker at each point; the every-step loss does not.
    sparse_log = os.path.join(w, "sparse.jsonl")
    with open(sparse_log, "w") as f:
        for k in range(20):
            f.write(json.dumps({"step": k, "loss": 3.0 - 0.05 * k}) + "\n")
            if k % 5 == 4:
                f.write(json.dumps({"step": k, "eval_loss": 3.1 - 0.05 * k}) + "\n")
    sparse_svg = os.path.join(w, "sparse.svg")
    rc, so, se = run([a.carve, "plot", sparse_log, "-o", sparse_svg])
    if rc != 0:
        raise Failure("carve plot of a sparse series failed:\n%s%s" % (so, se))
    marks = [c.get("data-series") for c in ET.parse(sparse_svg).getroot().iter(ns + "circle")
             if c.get("class") == "marker"]
    if marks != ["eval_loss"] * 4:
        raise Failure("sparse.svg: markers %s, expected one per evaluation (4) and none on the "
                      "every-step loss" % marks)
    print("ok: carve plot marks the 4 points of a sparse evaluation curve")

    # 3. Bad input.
    bad = os.path.join(w, "bad.jsonl")
    with open(bad, "w") as f:
        f.write('{"step": 0, "loss": 1.0}\nnot json\n')
    never = os.path.join(w, "never.svg")
    for args, message in [([bad, "-o", never], bad + ": line 2 is not JSON"),
                          ([os.path.join(w, "missing.jsonl"), "-o", never], "missing.jsonl"),
                          ([logs[0]], "-o FILE.svg is required")]:
        rc, so, se = run([a.carve, "plot"] + args)
        errors = [l for l in se.splitlines() if l.strip()]
        if rc != 1 or len(errors) != 1 or message not in errors[0] or os.path.exists(never):
            raise Failure("carve plot %s: expected exit 1 with one line naming '%s', got %d:\n"
                          "%s%s" % (args, message, rc, so, se))
    afile = os.path.join(w, "afile")
    open(afile, "w").close()
    log = os.path.join(w, "refused.jsonl")
    rc, so, se = run([a.carve, "run", os.path.join(w, "gpt-1rank"), "-n", "1", "--", "--steps",
                      "2", "--data", data, "--log", log, "--tensorboard", afile])
    if rc == 0 or "--tensorboard path exists and is not a folder" not in se or \
            os.path.exists(log):
        raise Failure("--tensorboard FILE: expected one line and nothing written, got %d:\n%s%s"
                      % (rc, so, se))
    print("ok: bad logs, a missing -o and a --tensorboard file refused, one line each, nothing "
          "written")


if __name__ == "__main__":
    try:
        main()
    except (Failure, subprocess.TimeoutExpired) as e:
        print("FAIL: %s" % e)
        sys.exit(1)
