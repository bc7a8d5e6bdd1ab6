"""Fine-tune the GPT example from saved weights.

``--init`` is either a ``.npz`` of consolidated weights (``examples/train_gpt.py
--save-weights`` or ``zerojax export --format npz``) or a zerojax checkpoint directory, which is
consolidated through ``zerojax.export``. The model preset (and sequence length) is
read from the stored parameter shapes unless ``--preset`` names it. The weights are placed
straight into the run's ZeRO layout, so fine-tuning may use a different stage or device count
than pretraining. Usage::

  python examples/train_gpt.py --save-weights --out-dir runs/pretrain
  python examples/finetune.py --init runs/pretrain/weights.npz --stage 2 --lr 5e-4
  python examples/finetune.py --init checkpoints/run1 --corpus my_text.txt
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent

from zerojax import DEFAULT_CORPUS  # the bundled corpus (package data)


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--init", required=True,
                 help="weights to start from: a .npz file or a zerojax checkpoint directory")
  p.add_argument("--config", default=None, help="zerojax or DeepSpeed config (.json/.yaml)")
  p.add_argument("--stage", type=int, default=None, help="override the config's stage")
  p.add_argument("--preset", default=None,
                 help="model preset of the weights (default: inferred from the stored "
                      "parameter shapes)")
  p.add_argument("--steps", type=int, default=10, help="fine-tuning steps (default 10)")
  p.add_argument("--batch", type=int, default=16, help="global batch in rows (default 16)")
  p.add_argument("--lr", type=float, default=5e-4, help="peak learning rate (default 5e-4)")
  p.add_argument("--warmup-steps", type=int, default=2)
  p.add_argument("--corpus", default=str(DEFAULT_CORPUS),
                 help="text to fine-tune on (default: the bundled corpus)")
  p.add_argument("--out-dir", default="runs/finetune")
  p.add_argument("--cpu-devices", type=int, default=8)
  p.add_argument("--no-progress", action="store_true")
  return p.parse_args(argv)


def main(argv=None) -> int:
  args = parse_args(argv)
  from zerojax import train as zt
  from zerojax import ConfigError, load_config
  if not os.path.exists(args.init):
    print(f"finetune: --init {args.init!r} does not exist", file=sys.stderr)
    return 2
  loaded = load_config(args.config, [] if args.stage is None else [f"stage={args.stage}"])
  zt.setup_cpu_devices(args.cpu_devices)
  config = loaded.config
  model = {"model": args.preset}
  if args.preset is None:  # the weights say which model they are (shapes; no arrays read)
    try:
      model["model"], model["seq_len"] = zt.infer_model(args.init)
    except ConfigError as e:
      print(f"finetune: {e}", file=sys.stderr)
      return 2
  opts = zt.TrainOptions(**{
      **loaded.train, **model,
      "steps": args.steps, "batch": args.batch, "lr": args.lr,
      "warmup_steps": args.warmup_steps, "decay": "cosine", "corpus": args.corpus,
      "out_dir": args.out_dir, "cpu_devices": args.cpu_devices,
      "progress": False if args.no_progress else None, "init_from": args.init, "log_every": 5,
      "show_plan": False})
  zt.log(f"fine-tuning {opts.model} from {args.init}"
         + ("" if args.preset else " (model inferred from the stored shapes)"))
  result = zt.train(config, opts)
  return 0 if result.history else 1


if __name__ == "__main__":
  sys.exit(main())
