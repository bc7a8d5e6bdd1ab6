"""ZeroConfig: loading, validation and its error messages."""

import json
import pathlib

import pytest

from zerojax import ConfigError, ZeroConfig, make_mesh

CONFIGS = pathlib.Path(__file__).parent.parent / "configs"


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_shipped_configs_load(stage):
  cfg = ZeroConfig.from_file(CONFIGS / f"zero{stage}.json")
  assert cfg.stage == stage and cfg.mesh_axes == ("fsdp",)


def test_yaml_config_loads():
  cfg = ZeroConfig.from_file(CONFIGS / "zero3_hsdp.yaml")
  assert cfg.mesh_axes == ("replica", "fsdp") and cfg.compute_dtype == "bfloat16"
  mesh = make_mesh(cfg)
  assert dict(mesh.shape) == {"replica": 2, "fsdp": 4}


def test_round_trip_json(tmp_path):
  cfg = ZeroConfig(stage=2, rules=(("embed", (None, "fsdp")),))
  p = tmp_path / "c.json"
  p.write_text(json.dumps(cfg.to_dict()))
  assert ZeroConfig.from_file(p) == cfg


@pytest.mark.parametrize("kwargs, field, allowed", [
    ({"stage": 4}, "stage=4", "0, 1, 2 and 3"),
    ({"stage": -1}, "stage=-1", "0, 1, 2 and 3"),
    ({"param_persistence_threshold": -5}, "param_persistence_threshold=-5", ">= 0"),
    ({"mesh_shape": (-2,)}, "mesh_shape=(-2,)", "positive integers"),
    ({"mesh_shape": (3,)}, "mesh_shape=(3,)", "8 are available"),
    ({"mesh_shape": (2, 2), "mesh_axes": ("replica", "fsdp")}, "mesh_shape=(2, 2)",
     "8 are available"),
    ({"mesh_shape": (-1, -1), "mesh_axes": ("replica", "fsdp")}, "mesh_shape", "at most one"),
    ({"mesh_axes": ("data",)}, "mesh_axes", "allowed axes"),
    ({"mesh_axes": ("replica",)}, "mesh_axes", "must contain 'fsdp'"),
    ({"param_dtype": "float8"}, "param_dtype='float8'", "allowed dtypes"),
    ({"micro_batch_per_device": 0}, "micro_batch_per_device=0", "positive integer"),
    ({"offload_params": True, "stage": 2}, "offload_params=True", "needs stage 3"),
    ({"offload_optimizer": True, "stage": 0}, "offload_optimizer=True", "stage >= 1"),
    ({"remat": "everything"}, "remat='everything'", "allowed policies"),
    ({"gradient_clipping": -1.0}, "gradient_clipping=-1.0", "positive number"),
])
def test_bad_values_name_field_value_and_allowed(kwargs, field, allowed):
  with pytest.raises(ConfigError) as e:
    ZeroConfig(**kwargs)
  assert field in str(e.value) and allowed in str(e.value)


def test_unknown_key_is_named():
  with pytest.raises(ConfigError, match="no field 'stgae'"):
    ZeroConfig.from_dict({"stgae": 3})


def test_unknown_key_in_file(tmp_path):
  p = tmp_path / "bad.yaml"
  p.write_text("stage: 2\nbucket: 5\n")
  with pytest.raises(ConfigError, match="'bucket'"):
    ZeroConfig.from_file(p)


def test_missing_file():
  with pytest.raises(FileNotFoundError, match="does not exist"):
    ZeroConfig.from_file("/nonexistent/zero.json")


def test_mesh_minus_one_fills_devices():
  assert ZeroConfig(mesh_shape=(2, -1), mesh_axes=("replica", "fsdp")).resolved_mesh_shape(8) \
      == (2, 4)


def test_unknown_field_suggests_the_closest():
  with pytest.raises(ConfigError, match=r"no field 'stgae' \(did you mean 'stage'\?\)"):
    ZeroConfig.from_dict({"stgae": 3})
  with pytest.raises(ConfigError, match=r"no field 'offload_optimiser' \(did you mean "
                     r"'offload_optimizer'\?\)"):
    ZeroConfig().replace(offload_optimiser=True)
  with pytest.raises(ConfigError) as e:
    ZeroConfig.from_dict({"zzz": 3})
  assert "did you mean" not in str(e.value) and "allowed keys are" in str(e.value)


def test_typo_inside_a_file_names_the_file(tmp_path):
  p = tmp_path / "typo.yaml"
  p.write_text("stage: 2\nparam_persistance_threshold: 10\n")
  with pytest.raises(ConfigError, match=r"config file '.*typo\.yaml': ZeroConfig has no field "
                     r"'param_persistance_threshold' \(did you mean "
                     r"'param_persistence_threshold'\?\)"):
    ZeroConfig.from_file(p)
