#!/usr/bin/env python3
"""A JobSet for a multi-slice TPU training run on GKE: one Job per slice, one pod per TPU host.

  python launch/gke_jobset.py --name lc-8b --slices 4 --topology 4x4x4 --accelerator tpu-v5p-slice \\
      --image us-docker.pkg.dev/PROJECT/REPO/longctx:TAG --config configs/base.py:llama3_8b_128k \\
      --workdir gs://BUCKET/runs/lc-8b --dry-run [-- --config.train.num_steps=1000 ...]

--dry-run prints the manifest (YAML); without it the manifest goes to `kubectl apply -f -`.

Every pod runs the same command, `python3 scripts/train.py --config=... --workdir=...
--config.mesh.dcn_<axis>=<slices> [train.py flags after --]`: the mesh's `dcn_<axis>` size spans the
slices over the data-centre network, and the config's (dp, fsdp, sp) sizes apply within each slice.
GKE gives every pod TPU_WORKER_ID / TPU_WORKER_HOSTNAMES (and the MEGASCALE_* variables of a
multi-slice job), from which `jax.distributed.initialize()` finds its peers
(`longctx.parallel.mesh.maybe_initialize_distributed`).

The JobSet annotation `alpha.jobset.sigs.k8s.io/exclusive-topology: cloud.google.com/gke-nodepool`
keeps each slice's pods on one node pool (one physical slice). Pods get
--termination-grace-period seconds between SIGTERM and SIGKILL, in which longctx finishes its step
and saves a checkpoint; JobSet restarts the whole set up to --max-restarts times, and the run
resumes from that checkpoint.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys

PROG = "launch/gke_jobset.py"
DCN_AXES = ("dp", "fsdp", "sp")


class BadInput(Exception):
    """Bad input: printed as one sentence, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse whose errors (a flag that is not a number, one missing) are one BadInput line, not
    a usage block; the flags' ranges are checked in `validate`."""

    def error(self, message: str):
        raise BadInput(f"{message} ({PROG} -h lists the flags).")


def parse_args(argv: list[str]) -> argparse.Namespace:
    if "--" in argv:
        split = argv.index("--")
        own, extra = argv[:split], argv[split + 1:]
    else:
        own, extra = argv, []
    p = _Parser(prog=PROG, description="Multi-slice TPU JobSet for longctx training.")
    p.add_argument("--name", default="longctx", help="JobSet name (lowercase letters, digits, '-')")
    p.add_argument("--namespace", default="default")
    p.add_argument("--slices", type=int, required=True, help="number of TPU slices (Jobs)")
    p.add_argument("--topology", required=True, help="TPU topology of one slice, e.g. 4x4x4")
    p.add_argument("--accelerator", default="tpu-v5p-slice",
                   help="GKE TPU accelerator label: tpu-v5p-slice, tpu-v6e-slice, tpu-v5-lite-podslice, ...")
    p.add_argument("--chips-per-host", type=int, default=4, help="TPU chips per VM (4 on multi-host slices)")
    p.add_argument("--image", required=True, help="container image with longctx installed")
    p.add_argument("--image-dir", default="/app", help="directory of the longctx checkout in the image")
    p.add_argument("--config", default="configs/base.py:llama3_8b_128k")
    p.add_argument("--workdir", required=True, help="gs:// path for checkpoints, metrics and logs")
    p.add_argument("--dcn-axis", choices=DCN_AXES, default="dp",
                   help="the mesh axis that spans the slices (mesh.dcn_<axis> = --slices)")
    p.add_argument("--max-restarts", type=int, default=3,
                   help="JobSet restarts after a failure or preemption (0 or more)")
    p.add_argument("--termination-grace-period", type=int, default=120,
                   help="seconds between SIGTERM and SIGKILL (time to save a checkpoint; 0 or more)")
    p.add_argument("--dry-run", action="store_true", help="print the manifest instead of applying it")
    args = p.parse_args(own)
    args.train_args = extra
    return args


def topology_chips(topology: str) -> int:
    if not re.fullmatch(r"[1-9]\d*(x[1-9]\d*){1,2}", topology):
        raise BadInput(f"--topology {topology!r} is not a TPU topology like 4x4x4 or 8x16.")
    return math.prod(int(d) for d in topology.split("x"))


def validate(args: argparse.Namespace) -> int:
    """Checks the arguments; returns the number of hosts (pods) per slice."""
    if not re.fullmatch(r"[a-z]([-a-z0-9]{0,38}[a-z0-9])?", args.name):
        raise BadInput(f"--name {args.name!r} must be 1-40 lowercase letters, digits or '-', starting with a letter.")
    if args.slices < 1:
        raise BadInput(f"--slices must be at least 1, got {args.slices}.")
    if args.chips_per_host < 1:
        raise BadInput(f"--chips-per-host must be at least 1, got {args.chips_per_host}.")
    chips = topology_chips(args.topology)
    if chips % args.chips_per_host:
        raise BadInput(f"--topology {args.topology} has {chips} chips, not a multiple of the "
                       f"{args.chips_per_host} chips per host.")
    if not args.workdir.startswith("gs://") or len(args.workdir) <= len("gs://"):
        raise BadInput(f"--workdir {args.workdir!r} must be a gs:// path: every host writes checkpoints there.")
    if args.max_restarts < 0 or args.termination_grace_period < 0:
        raise BadInput("--max-restarts and --termination-grace-period must not be negative.")
    for a in args.train_args:
        if re.match(r"--config\.mesh\.dcn_", a):
            raise BadInput(f"{a} is set by {PROG} from --slices and --dcn-axis; drop it.")
    return chips // args.chips_per_host


def train_command(args: argparse.Namespace) -> list[str]:
    return ["python3", "scripts/train.py", f"--config={args.config}", f"--workdir={args.workdir.rstrip('/')}",
            f"--config.mesh.dcn_{args.dcn_axis}={args.slices}", *args.train_args]


def manifest(args: argparse.Namespace, hosts: int) -> dict:
    container = {
        "name": "longctx",
        "image": args.image,
        "imagePullPolicy": "Always",
        "workingDir": args.image_dir,
        "command": train_command(args),
        "env": [
            {"name": "PYTHONUNBUFFERED", "value": "1"},
            {"name": "LONGCTX_NUM_SLICES", "value": str(args.slices)},
            {"name": "JOBSET_NAME",
             "valueFrom": {"fieldRef": {"fieldPath": "metadata.annotations['jobset.sigs.k8s.io/jobset-name']"}}},
            {"name": "LONGCTX_SLICE_ID",
             "valueFrom": {"fieldRef": {"fieldPath": "metadata.annotations['jobset.sigs.k8s.io/job-index']"}}},
        ],
        # 8471: TPU runtime; 8080: multi-slice (megascale) transport; 8476: jax.distributed coordinator.
        "ports": [{"containerPort": 8471}, {"containerPort": 8080}, {"containerPort": 8476}],
        "securityContext": {"privileged": True},
        "resources": {"limits": {"google.com/tpu": args.chips_per_host}},
    }
    pod = {
        "hostNetwork": True,
        "dnsPolicy": "ClusterFirstWithHostNet",
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": args.termination_grace_period,
        "nodeSelector": {
            "cloud.google.com/gke-tpu-accelerator": args.accelerator,
            "cloud.google.com/gke-tpu-topology": args.topology,
        },
        "containers": [container],
    }
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {
            "name": args.name,
            "namespace": args.namespace,
            "annotations": {"alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"},
        },
        "spec": {
            "failurePolicy": {"maxRestarts": args.max_restarts},
            "replicatedJobs": [{
                "name": "slice",
                "replicas": args.slices,
                "template": {"spec": {
                    "parallelism": hosts,
                    "completions": hosts,
                    "backoffLimit": 0,  # any pod failing fails the slice; JobSet restarts the set
                    "template": {"spec": pod},
                }},
            }],
        },
    }


# ----------------------------------------------------------------------------- YAML (block style, no deps)


def _scalar(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    text = str(value)
    if re.fullmatch(r"[A-Za-z_/][-A-Za-z0-9_./:@]*", text) and text.lower() not in (
            "true", "false", "yes", "no", "on", "off", "null", "y", "n"):
        return text
    return json.dumps(text)  # a JSON string is a valid YAML double-quoted scalar


def to_yaml(value, indent: int = 0) -> str:
    pad = " " * indent
    lines = []
    if isinstance(value, dict):
        for k, v in value.items():
            if isinstance(v, (dict, list)) and v:
                lines.append(f"{pad}{_scalar(k)}:")
                lines.append(to_yaml(v, indent + 2))
            else:
                lines.append(f"{pad}{_scalar(k)}: {_scalar(v) if not isinstance(v, (dict, list)) else '{}' if isinstance(v, dict) else '[]'}")
    elif isinstance(value, list):
        for v in value:
            if isinstance(v, (dict, list)) and v:
                body = to_yaml(v, indent + 2)
                lines.append(f"{pad}- {body[indent + 2:]}")
            else:
                lines.append(f"{pad}- {_scalar(v)}")
    else:
        lines.append(f"{pad}{_scalar(value)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parse_args(argv)
        hosts = validate(args)
    except BadInput as e:
        sys.stderr.write(f"{PROG}: {e}\n")
        return 2
    text = to_yaml(manifest(args, hosts)) + "\n"
    header = (f"# longctx: {args.slices} slice(s) x {args.topology} {args.accelerator} "
              f"({hosts} host(s) x {args.chips_per_host} chips per slice); "
              f"mesh.dcn_{args.dcn_axis}={args.slices}\n")
    if args.dry_run:
        sys.stdout.write(header + text)
        return 0
    try:
        return subprocess.run(["kubectl", "apply", "-f", "-"], input=text, text=True).returncode
    except FileNotFoundError:
        sys.stderr.write(f"{PROG}: kubectl is not installed; use --dry-run to print the manifest.\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
