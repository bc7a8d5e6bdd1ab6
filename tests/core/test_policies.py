"""`ZeroConfig` as a stage plus typed policies: each policy checks itself, the flat spelling
maps onto the policies one to one, and the flat keywords of zerojax 0.1 still work, warned."""

from __future__ import annotations

import json
import warnings

import pytest

import zerojax
from zerojax import (Batch, ConfigError, Gather, HostOffload, LossScale, NvmeOffload, Precision,
                     Quantize, Remat, ZeroConfig)
from zerojax.core import validation


@pytest.fixture(autouse=True)
def _no_deprecation():
  """The typed spelling never warns; a test that uses the flat keywords says so."""
  with warnings.catch_warnings():
    warnings.simplefilter("error", DeprecationWarning)
    yield


@pytest.mark.parametrize("make, message", [
    (lambda: Precision(compute="fp8"), "Precision.compute='fp8' is invalid: allowed dtypes"),
    (lambda: Precision(reduce="int8"), "Precision.reduce='int8' is invalid"),
    (lambda: HostOffload(fallback="maybe"), "HostOffload.fallback='maybe' is invalid"),
    (lambda: HostOffload(optimizer="yes"), "HostOffload.optimizer='yes' is invalid: true or false"),
    (lambda: HostOffload(optimizer=False), "HostOffload moves nothing"),
    (lambda: HostOffload(optimizer=False, update_on_host=True),
     "HostOffload.update_on_host=True is invalid: needs offload_optimizer=True"),
    (lambda: NvmeOffload(""), "NvmeOffload.path='' is invalid"),
    (lambda: NvmeOffload("/x", buffer_count=0), "NvmeOffload.buffer_count=0 is invalid"),
    (lambda: Remat("sometimes"), "Remat.policy='sometimes' is invalid"),
    (lambda: Remat("offload"), "Remat.offload_names=() is invalid"),
    (lambda: Gather("implicit"), "Gather.mode='implicit' is invalid"),
    (lambda: Gather(max_live_layers=0), "Gather.max_live_layers=0 is invalid"),
    (lambda: Gather(persistence_threshold=-1), "Gather.persistence_threshold=-1 is invalid"),
    (lambda: Quantize(), "Quantize needs weights or gradients"),
    (lambda: Quantize(weights="int2"), "Quantize.weights='int2' is invalid"),
    (lambda: Quantize(weights="int8", block_size=3), "Quantize.block_size=3 is invalid"),
    (lambda: Batch(global_size=0), "Batch.global_size=0 is invalid"),
    (lambda: LossScale(scale=-1.0), "LossScale.scale=-1.0 is invalid"),
    (lambda: LossScale(window=0), "LossScale.window=0 is invalid"),
])
def test_each_policy_checks_itself_and_names_itself(make, message):
  with pytest.raises(ConfigError) as e:
    make()
  assert message in str(e.value)


@pytest.mark.parametrize("config, message", [
    (lambda: ZeroConfig(stage=0, offload=HostOffload()),
     "ZeroConfig.offload.optimizer=True is invalid: needs stage >= 1"),
    (lambda: ZeroConfig(stage=2, offload=HostOffload(params=True)),
     "ZeroConfig.offload.params=True is invalid: needs stage 3"),
    (lambda: ZeroConfig(stage=2, quantize=Quantize(weights="int8")),
     "ZeroConfig.quantize.weights='int8' is invalid: needs stage 3"),
    (lambda: ZeroConfig(stage=1, quantize=Quantize(gradients="int8")),
     "ZeroConfig.quantize.gradients='int8' is invalid: needs stage 2 or 3"),
    (lambda: ZeroConfig(offload=HostOffload(params=True), quantize=Quantize(weights="int8")),
     "ZeroConfig.offload.params=True is invalid: cannot be combined with quantize"),
    (lambda: ZeroConfig(loss_scale=LossScale(), nonfinite_grads="halt"),
     "ZeroConfig.nonfinite_grads='halt' is invalid: with loss scaling"),
    (lambda: ZeroConfig(precision="bfloat16"),
     "ZeroConfig.precision='bfloat16' is invalid: a Precision, a mapping of its fields"),
    (lambda: ZeroConfig(offload=True),
     "ZeroConfig.offload=True is invalid: a HostOffload or NvmeOffload"),
])
def test_rules_across_policies_name_the_setting_as_written(config, message):
  with pytest.raises(ConfigError) as e:
    config()
  assert message in str(e.value)


def test_nvme_cannot_hold_the_parameters_by_construction():
  # The flat spelling had to refuse offload_params with 'nvme'; the type has no such field.
  assert "params" not in {f for f in NvmeOffload.__dataclass_fields__}
  with pytest.raises(ConfigError, match="offload_params=True is invalid: cannot be combined with "
                     "offload_optimizer='nvme'"):
    ZeroConfig.from_flat({"offload_optimizer": "nvme", "nvme_path": "/x",
                          "offload_params": True})


FLAT_CASES = [
    {},
    {"stage": 2, "param_dtype": "bfloat16", "compute_dtype": "bfloat16",
     "reduce_dtype": "bfloat16"},
    {"offload_optimizer": True, "offload_params": True, "offload_fallback": "warn",
     "optimizer_on_host": True},
    {"offload_optimizer": "nvme", "nvme_path": "/nv", "nvme_chunk_size": 100,
     "nvme_buffer_count": 3, "nvme_pipeline_read": False, "nvme_pipeline_write": False},
    {"remat": "offload", "remat_offload_names": ["a", "b"], "gather": "explicit",
     "max_live_layers": 1, "param_persistence_threshold": 0},
    {"quantize_weights": "int4", "quantize_gradients": "int8",
     "quantize_weights_backward": False, "quantize_block_size": 64},
    {"train_batch_size": 32, "micro_batch_per_device": 2, "gradient_accumulation_steps": 2,
     "gradient_clipping": 1.0},
    {"compute_dtype": "float16", "loss_scale": 0.0, "initial_scale_power": 12,
     "loss_scale_window": 100, "hysteresis": 3, "min_loss_scale": 2.0},
    {"mesh_shape": [-1, 2], "mesh_axes": ["replica", "fsdp"], "rules": [["embed", [None, "fsdp"]]],
     "nonfinite_grads": "skip"},
]


@pytest.mark.parametrize("flat", FLAT_CASES)
def test_the_flat_spelling_maps_onto_the_policies_one_to_one(flat):
  c = ZeroConfig.from_flat(flat)
  assert {k: c.to_flat()[k] for k in flat} == flat  # every setting kept, as written
  assert set(c.to_flat()) == set(validation.FLAT_DEFAULTS)
  assert ZeroConfig.from_flat(c.to_flat()) == c
  # the sectioned form survives JSON, and each flat name reads back as a property
  assert ZeroConfig.from_dict(json.loads(json.dumps(c.to_dict()))) == c
  for k, v in flat.items():
    got = getattr(c, k)
    got = {"remat": lambda r: r.policy, "gather": lambda g: g.mode,
           "loss_scale": lambda s: s.scale}.get(k, lambda x: x)(got)
    assert json.loads(json.dumps(got)) == v, k


@pytest.mark.parametrize("flat", [f for f in FLAT_CASES
                                  if set(f) - set(ZeroConfig.__dataclass_fields__)])
def test_the_flat_keywords_still_construct_the_same_config_with_a_warning(flat):
  with pytest.warns(DeprecationWarning, match="ZeroConfig's flat keywords are deprecated"):
    old = ZeroConfig(**flat)
  assert old == ZeroConfig.from_flat(flat)


def test_the_warning_names_each_keyword_and_its_policy():
  with pytest.warns(DeprecationWarning) as w:
    ZeroConfig(compute_dtype="bfloat16", micro_batch_per_device=2)
  message = str(w[0].message)
  assert "compute_dtype -> precision=Precision(compute=...)" in message
  assert "micro_batch_per_device -> batch=Batch(micro_per_device=...)" in message


def test_short_spellings_keep_the_policy_s_other_fields():
  c = ZeroConfig(gather=Gather(max_live_layers=1), remat="full", loss_scale=0)
  assert c.remat == Remat("full") and c.loss_scale == LossScale(0)
  assert c.replace(gather="explicit").gather == Gather("explicit", max_live_layers=1)
  scaled = ZeroConfig(loss_scale=LossScale(hysteresis=3)).replace(loss_scale=128.0)
  assert scaled.loss_scale == LossScale(128.0, hysteresis=3)
  # remat='offload' is checked together with its names
  assert ZeroConfig(remat=Remat("offload", ("x",))).replace(remat="offload").remat.offload_names


def test_replace_with_a_flat_keyword_warns_and_changes_only_it():
  c = ZeroConfig(stage=3, offload=HostOffload(fallback="warn"),
                 precision=Precision(compute="bfloat16"))
  with pytest.warns(DeprecationWarning, match="offload_params -> offload=HostOffload"):
    d = c.replace(offload_params=True)
  assert d.offload == HostOffload(params=True, fallback="warn") and d.precision == c.precision
  assert c.replace(offload=None).offload is None


def test_unknown_fields_suggest_either_spelling():
  with pytest.raises(ConfigError, match=r"no field 'precison' \(did you mean 'precision'\?\)"):
    ZeroConfig(precison=Precision())
  with pytest.raises(ConfigError, match=r"no field 'compute_dtpye' \(did you mean "
                     r"'compute_dtype'\?\)"):
    ZeroConfig.from_dict({"compute_dtpye": "bfloat16"})
  with pytest.raises(ConfigError, match=r"Precision has no field 'comput' \(did you mean "
                     r"'compute'\?\)"):
    ZeroConfig.from_dict({"precision": {"comput": "bfloat16"}})
  with pytest.raises(ConfigError, match=r"ZeroConfig.offload.kind='disk' is invalid"):
    ZeroConfig.from_dict({"offload": {"kind": "disk"}})
  with pytest.raises(ConfigError, match=r"NvmeOffload needs 'path'"):
    ZeroConfig.from_dict({"offload": {"kind": "nvme"}})


def test_a_file_may_use_sections_or_flat_keys(tmp_path):
  sectioned = tmp_path / "run.yaml"
  sectioned.write_text("stage: 2\nprecision:\n  compute: bfloat16\noffload:\n  kind: host\n"
                       "batch:\n  micro_per_device: 2\n")
  c = zerojax.load_config(sectioned, apply_xla_flags=False, for_training=False).config
  assert c == ZeroConfig(stage=2, precision=Precision(compute="bfloat16"),
                         offload=HostOffload(), batch=Batch(micro_per_device=2))
  # flat keys, as command-line overrides write them, mixed with sections: no warning
  flat = tmp_path / "flat.yaml"
  flat.write_text("stage: 2\ncompute_dtype: bfloat16\noffload:\n  kind: host\n"
                  "micro_batch_per_device: 2\n")
  assert zerojax.load_config(flat, apply_xla_flags=False, for_training=False).config == c
  # command-line overrides are flat keys by design: no warning
  over = zerojax.load_config(sectioned, ["offload_params=true", "stage=3"],
                             apply_xla_flags=False, for_training=False).config
  assert over.offload == HostOffload(params=True) and over.precision.compute == "bfloat16"


def test_configs_are_hashable_values():
  a = ZeroConfig(offload=NvmeOffload("/nv"), quantize=None, rules=[("x", ["fsdp"])])
  b = ZeroConfig.from_dict(a.to_dict())
  assert a == b and hash(a) == hash(b) and len({a, b}) == 1


@pytest.mark.parametrize("make, field, setting", [
    (lambda: zerojax.LossScale(window=0), "LossScale.window", "loss_scale.window"),
    (lambda: zerojax.ZeroConfig(stage=2, offload=zerojax.HostOffload(params=True)),
     "offload.params", "offload.params"),
    (lambda: zerojax.ZeroConfig.from_flat({"offload_params": "yes"}), "offload_params",
     "offload.params"),
])
def test_errors_carry_the_refused_setting(make, field, setting):
  """A refusal names its setting as data as well as in words, so that a front end (the
  DeepSpeed mapping, a command line) can report it by the key its user wrote."""
  from zerojax.core.config import setting_of
  with pytest.raises(zerojax.ConfigError) as e:
    make()
  assert e.value.field == field and setting_of(e.value.field) == setting
  assert e.value.allowed and f"{e.value.value!r} is invalid: {e.value.allowed}" in str(e.value)
