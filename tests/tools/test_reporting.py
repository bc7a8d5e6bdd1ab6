"""What runs print: parameter counts, throughput, plan notes, help texts."""

import pathlib
import re

import pytest

import zerojax
from zerojax.tools import cli
from zerojax.models import PRESETS

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _counts(text: str) -> tuple[int, int]:
  header = re.search(r"^model \S+: ([\d,]+) parameters", text, re.M)
  table = re.search(r"^parameters: ([\d,]+) ", text, re.M)
  assert header and table, text[-2000:]
  return int(header.group(1).replace(",", "")), int(table.group(1).replace(",", ""))


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_plan_header_and_table_count_the_same_parameters(preset, capsys):
  cfg = str(ROOT / "configs/zero3.json")
  assert cli.main(["plan", cfg, "--model", preset, "--devices", "8"]) == 0
  header, table = _counts(capsys.readouterr().out)
  assert header == table == PRESETS[preset].num_params()


def _gpt_params(c) -> int:
  """GPT's parameters counted by hand from its layers: token and position embeddings; per
  block two LayerNorms (scale and bias), qkv without bias, proj, fc and out with bias; the
  final LayerNorm; the head with its bias."""
  d, f = c.d_model, c.mlp_ratio * c.d_model
  block = 2 * 2 * d + 3 * d * d + (d * d + d) + (d * f + f) + (f * d + d)
  return (c.vocab_size * d + c.seq_len * d + c.num_layers * block + 2 * d
          + d * c.vocab_size + c.vocab_size)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_num_params_counts_every_leaf_of_the_tree(preset):
  import dataclasses
  cfg = PRESETS[preset]
  assert cfg.num_params() == _gpt_params(cfg)  # head/bias included (a closed formula dropped it)
  # scanned or not, at another depth and MLP width, the same layers
  other = dataclasses.replace(cfg, scan=not cfg.scan, num_layers=3, mlp_ratio=cfg.mlp_ratio + 1)
  assert other.num_params() == _gpt_params(other)


@pytest.mark.slow
def test_train_reports_each_steps_own_throughput_and_none_for_the_first(tmp_path, capsys):
  from zerojax.tools import train as zt
  from zerojax.core.config import ZeroConfig
  from zerojax.runtime.memory import num_params
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


# -- text that must agree with the code -------------------------------------------------------


def test_export_help_names_the_command_it_was_run_as(capsys):
  from zerojax.tools import export
  with pytest.raises(SystemExit):
    cli.main(["export", "--help"])
  assert capsys.readouterr().out.startswith("usage: zerojax export ")
  with pytest.raises(SystemExit):
    export.main(["--help"])
  assert capsys.readouterr().out.startswith("usage: python -m zerojax.tools.export ")


def test_deepspeed_reduce_scatter_note_says_what_each_stage_does():
  from zerojax.tools.deepspeed import map_deepspeed
  m = map_deepspeed({"train_batch_size": 8,
                     "zero_optimization": {"stage": 1, "reduce_scatter": True}})
  note = next(n for n in m.notes if "reduce_scatter" in n)
  assert "stage 1 reduce-scatters each device's local gradient once" in note
  assert "0-1 all-reduce" not in note and "stage 0 all-reduces" in note


def _table_rows(table: str) -> dict[str, list[str]]:
  lines = table.splitlines()
  head = lines[1]
  starts = [head.index(c) for c in ("path", "shape", "dtype", "param spec", "opt spec",
                                     "bytes/device", "note")]
  rows = {}
  for line in lines[3:]:
    if not line.strip():
      break
    cells = [line[a:b].strip() for a, b in zip(starts, starts[1:] + [None])]
    rows[cells[0]] = cells
  return rows


def _plan(stage, **kw):
  import jax.numpy as jnp
  import optax
  import zerojax
  cfg = zerojax.ZeroConfig.from_flat(dict(stage=stage, **kw))
  return zerojax.ShardingPlan.create(cfg, zerojax.make_mesh(cfg), {
      "big": jnp.zeros((64, 128)), "bias": jnp.zeros((3,))}, tx=optax.adam(1e-3))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_plan_table_notes_say_what_the_plans_shardings_split(stage):
  """Each leaf's note names the state that the plan's own shardings split over ``fsdp``: the
  parameters at rest, the gradients leaving the backward pass, the optimizer state."""
  import jax
  plan = _plan(stage, param_persistence_threshold=64)
  rows = _table_rows(plan.table())
  fsdp = lambda sh: "fsdp" in jax.tree.leaves(tuple(sh.spec))
  opt = {}
  for i, sh in zip(plan.opt_param, jax.tree.leaves(plan.opt_state)):
    if i is not None:
      opt[i] = opt.get(i, False) or fsdp(sh)
  split_by_path = {}
  for i, (lp, ps, gs) in enumerate(zip(plan.leaves, jax.tree.leaves(plan.params),
                                       jax.tree.leaves(plan.grads))):
    split = {"params": fsdp(ps), "grads": fsdp(gs), "opt state": opt[i]}
    split_by_path[lp.path] = split
    note, row = rows[lp.path][6], rows[lp.path]
    if not any(split.values()):
      assert note.startswith("replicated"), (lp.path, note)
    elif all(split.values()):
      assert note == "sharded", (lp.path, note)
    else:
      assert not note.startswith("replicated") and note.endswith("sharded"), (lp.path, note)
      assert ("grads" in note) == split["grads"] and ("opt state" in note) == split["opt state"]
    # the spec columns are the plan's shardings too
    assert ("'fsdp'" in row[3]) == split["params"] and ("'fsdp'" in row[4]) == split["opt state"]
  # the threshold leaf stays whole at every stage; the large one is split from stage 1 on
  assert rows["bias"][6] == "replicated (threshold)"
  assert sum(split_by_path["big"].values()) == stage


def test_plan_table_marks_host_memory_in_both_spec_columns():
  rows = _table_rows(_plan(2, offload_optimizer=True).table())
  assert rows["big"][4].endswith("(host)") and "(host)" not in rows["big"][3]
  rows = _table_rows(_plan(3, offload_optimizer=True, offload_params=True).table())
  assert rows["big"][3].endswith("(host)") and rows["big"][4].endswith("(host)")


def test_plan_that_shards_nothing_says_so_and_why(capsys):
  cfg = str(ROOT / "configs/ds_zero3_offload.json")
  assert cli.main(["plan", cfg, "--model", "tiny", "--devices", "8"]) == 0
  out = capsys.readouterr().out
  assert "note: stage 3 shards nothing here" in out
  assert "below param_persistence_threshold=100,000 elements" in out
  # The README's command with this config uses a model it does shard.
  model = re.search(r"zerojax train configs/ds_zero3_offload\.json model=(\S+)",
                    (ROOT / "README.md").read_text()).group(1)
  assert cli.main(["plan", cfg, "--model", model, "--devices", "8"]) == 0
  out = capsys.readouterr().out
  assert "shards nothing" not in out
  assert re.search(r"^blocks/fc/kernel .*P\(None, None, 'fsdp'\)", out, re.M), out


@pytest.mark.slow
def test_training_run_that_shards_nothing_says_so(tmp_path, capsys):
  from zerojax.tools import train as zt
  from zerojax.core.config import ZeroConfig
  zt.train(ZeroConfig(stage=2, gather=zerojax.Gather(persistence_threshold=10**9)), zt.TrainOptions(
      model="tiny", seq_len=32, steps=1, batch=8, out_dir=str(tmp_path), progress=False,
      show_plan=False, plot=False, tensorboard=False))
  out = capsys.readouterr().out
  assert "note: stage 2 shards nothing here" in out and "param_persistence_threshold" in out
