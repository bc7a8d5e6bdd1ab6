"""What runs print: parameter counts, throughput, plan notes, help texts."""

import pathlib
import re

import pytest

from zerojax import cli
from zerojax.models import PRESETS

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _counts(text: str) -> tuple[int, int]:
  header = re.search(r"^model \S+: ([\d,]+) parameters", text, re.M)
  table = re.search(r"^parameters: ([\d,]+) ", text, re.M)
  assert header and table, text[-2000:]
  return int(header.group(1).replace(",", "")), int(table.group(1).replace(",", ""))


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_plan_header_and_table_count_the_same_parameters(preset, capsys):
  assert cli.main(["plan", str(ROOT / "configs/zero3.json"), "--model", preset, "--devices", "8"]) == 0
  header, table = _counts(capsys.readouterr().out)
  assert header == table == PRESETS[preset].num_params()


def test_num_params_counts_every_leaf_of_the_tree():
  # head/bias included (the closed formula this replaced dropped it: 89,339,904)
  assert PRESETS["gpt-89m"].num_params() == 89_390_161


def test_train_reports_each_steps_own_throughput_and_none_for_the_first(tmp_path, capsys):
  from zerojax import train as zt
  from zerojax.config import ZeroConfig
  from zerojax.memory import num_params
  r = zt.train(ZeroConfig(stage=2), zt.TrainOptions(
      model="tiny", seq_len=32, steps=7, batch=8, log_every=3, out_dir=str(tmp_path),
      progress=False, show_plan=True, plot=False, tensorboard=False))
  out = capsys.readouterr().out
  assert _counts(out)[0] == _counts(out)[1] == num_params(r.state.params)
  h = r.history
  assert [x["step"] for x in h] == list(range(1, 8))
  # step 1 carries compilation/warm-up: no throughput at all rather than a spike
  assert h[0]["tokens_per_sec"] is None
  tps = [x["tokens_per_sec"] for x in h[1:]]
  assert all(t > 0 for t in tps)
  # per step, not per logging window (steps 2-3, 4-6 and 7 were fetched together)
  assert len(set(tps)) == len(tps), tps
  elapsed = [x["elapsed_sec"] for x in h]
  assert all(a < b for a, b in zip(elapsed, elapsed[1:])), elapsed
  # each step's throughput is its tokens over the time since the previous step finished
  for prev, cur in zip(h[1:], h[2:]):
    assert cur["tokens_per_sec"] == pytest.approx(
        8 * 32 / (cur["elapsed_sec"] - prev["elapsed_sec"]), rel=0.01)
  assert zt.read_jsonl(r.files["metrics"])[0]["tokens_per_sec"] is None
  assert "tokens/s after the first step" in out
