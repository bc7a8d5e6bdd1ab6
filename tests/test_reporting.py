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
