"""Pretrain a small byte-level GPT with zerojax on the bundled public-domain corpus.

With no accelerator present it runs on 8 simulated CPU devices. Usage::

  python examples/train_gpt.py                                  # ZeRO-3, 8 CPU devices
  python examples/train_gpt.py --config configs/zero2.json --steps 50
  python examples/train_gpt.py --config configs/ds_zero3_offload.json   # a DeepSpeed config

It prints the sharding plan and the per-device memory XLA measured, shows a progress bar
(loss, tokens/s, ETA) and leaves metrics.jsonl, TensorBoard event files and loss.png in
--out-dir. The same loop is `zerojax train CONFIG key=value ...` (see zerojax/tools/train/).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent

from zerojax import DEFAULT_CORPUS  # the bundled corpus (package data)


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--config", default=None, help="zerojax or DeepSpeed config (.json/.yaml); "
                 "default: ZeRO-3 over all devices")
  p.add_argument("--stage", type=int, default=None, help="override the config's stage")
  p.add_argument("--steps", type=int, default=None, help="optimizer steps (default 20)")
  p.add_argument("--batch", type=int, default=None,
                 help="global batch in rows, if the config sets none (default 16)")
  p.add_argument("--lr", type=float, default=None, help="peak learning rate (default 3e-3)")
  p.add_argument("--preset", default=None, help="model preset: tiny | small (default) | gpt-89m")
  p.add_argument("--corpus", default=str(DEFAULT_CORPUS), help="text file to train on")
  p.add_argument("--out-dir", default="runs/train_gpt",
                 help="metrics.jsonl, TensorBoard events, loss.png (default runs/train_gpt)")
  p.add_argument("--cpu-devices", type=int, default=8,
                 help="simulated CPU devices when no accelerator is present (default 8)")
  p.add_argument("--no-progress", action="store_true", help="no progress bar")
  p.add_argument("--save-weights", action="store_true",
                 help="write OUT_DIR/weights.npz at the end (input of examples/finetune.py)")
  p.add_argument("--checkpoint-dir", default=None,
                 help="save sharded checkpoints there (at the end, and every "
                      "--checkpoint-every steps); examples/finetune.py --init takes it")
  p.add_argument("--checkpoint-every", type=int, default=0)
  p.add_argument("--no-resume", action="store_true",
                 help="start a new run instead of resuming the checkpoints in --checkpoint-dir "
                      "(a previous run's metrics.jsonl in OUT_DIR is moved aside)")
  p.add_argument("--overwrite", action="store_true",
                 help="delete the previous run's files in OUT_DIR and its checkpoints first")
  return p.parse_args(argv)


def main(argv=None) -> int:
  args = parse_args(argv)
  from zerojax import train as zt
  from zerojax import load_config

  # Loads zerojax or DeepSpeed configs; DeepSpeed's XLA flags are set before JAX starts.
  loaded = load_config(args.config, [] if args.stage is None else [f"stage={args.stage}"])
  zt.setup_cpu_devices(args.cpu_devices)
  config = loaded.config
  # The config file's training options (DeepSpeed optimizer/scheduler, a YAML `train:`
  # section) apply unless given on the command line.
  explicit = {k: v for k, v in (("model", args.preset), ("steps", args.steps),
                                ("batch", args.batch), ("lr", args.lr)) if v is not None}
  opts = zt.TrainOptions(**{"model": "small", "steps": 20, "batch": 16, "lr": 3e-3,
                            "log_every": 5, **loaded.train, **explicit,
                            "corpus": args.corpus, "out_dir": args.out_dir,
                            "cpu_devices": args.cpu_devices,
                            "progress": False if args.no_progress else None,
                            "save_weights": args.save_weights,
                            "checkpoint_dir": args.checkpoint_dir,
                            "checkpoint_every": args.checkpoint_every,
                            "resume": not args.no_resume, "overwrite": args.overwrite})
  result = zt.train(config, opts, xla_notes=[f"DeepSpeed {n}" for n in loaded.notes])
  return 0 if result.history else 1


if __name__ == "__main__":
  sys.exit(main())
