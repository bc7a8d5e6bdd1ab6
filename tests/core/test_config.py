"""ZeroConfig: loading, validation and its error messages."""

import json
import pathlib

import pytest

from zerojax import ConfigError, ZeroConfig, make_mesh

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"


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
    ({"mesh_shape": (-1, -1), "mesh_axes": ("replica", "fsdp")}, "mesh_shape", "at most one"),
    ({"mesh_axes": ("data",)}, "mesh_axes", "allowed axes"),
    ({"mesh_axes": ("replica",)}, "mesh_axes", "must contain 'fsdp'"),
    ({"param_dtype": "float8"}, "param_dtype='float8'", "allowed dtypes"),
    ({"micro_batch_per_device": 0}, "micro_batch_per_device=0", "positive integer"),
    ({"offload_params": True, "stage": 2}, "offload_params=True", "needs stage 3"),
    ({"offload_optimizer": True, "stage": 0}, "offload_optimizer=True", "stage >= 1"),
    ({"remat": "everything"}, "remat='everything'", "allowed policies"),
    ({"gradient_clipping": -1.0}, "gradient_clipping=-1.0", "positive finite number"),
])
def test_bad_values_name_field_value_and_allowed(kwargs, field, allowed):
  with pytest.raises(ConfigError) as e:
    ZeroConfig.from_flat(kwargs)
  assert field in str(e.value) and allowed in str(e.value)


@pytest.mark.parametrize("kwargs, field", [
    ({"mesh_shape": (3,)}, "mesh_shape=(3,)"),
    ({"mesh_shape": (2, 2), "mesh_axes": ("replica", "fsdp")}, "mesh_shape=(2, 2)"),
])
def test_mesh_shape_is_checked_against_the_devices_by_make_mesh(kwargs, field):
  # A config does not depend on the live backend (valid before and after jax.devices());
  # the mesh built from it is checked against the devices there are.
  cfg = ZeroConfig.from_flat(kwargs)
  with pytest.raises(ConfigError) as e:
    make_mesh(cfg)
  assert field in str(e.value) and "8 are available" in str(e.value)


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
  from zerojax.core.mesh import mesh_shape
  assert mesh_shape((2, -1), ("replica", "fsdp"), 8) == (2, 4)
  with pytest.raises(ConfigError, match=r"ZeroConfig.mesh_shape=\(2, 3\) is invalid: mesh "
                     r"\{'replica': 2, 'fsdp': 3\} needs 6 devices but 8 are available") as e:
    mesh_shape((2, 3), ("replica", "fsdp"), 8)
  assert (e.value.field, e.value.value) == ("mesh_shape", (2, 3))
  with pytest.raises(ConfigError, match=r"the fixed sizes multiply to 3, which does not divide"):
    mesh_shape((3, -1), ("replica", "fsdp"), 8)


# -- string booleans, wrong types and files that would be read silently wrong (issue 15 item 2) --


@pytest.mark.parametrize("field", ["offload_optimizer", "offload_params", "optimizer_on_host"])
@pytest.mark.parametrize("value", ["false", "no", "true", 0, 1, None])
def test_bool_fields_must_be_booleans(field, value):
  with pytest.raises(ConfigError) as e:
    ZeroConfig.from_flat({"stage": 3, field: value})
  assert f"ZeroConfig.{field}={value!r} is invalid: true or false" in str(e.value)


def test_string_false_in_yaml_and_json_is_an_error(tmp_path):
  y = tmp_path / "c.yaml"
  y.write_text('stage: 3\noffload_optimizer: "false"\n')
  j = tmp_path / "c.json"
  j.write_text('{"stage": 3, "offload_params": "no"}')
  with pytest.raises(ConfigError, match=r"c\.yaml.*offload_optimizer='false' is invalid"):
    ZeroConfig.from_file(y)
  with pytest.raises(ConfigError, match=r"c\.json.*offload_params='no' is invalid"):
    ZeroConfig.from_file(j)
  y.write_text("stage: 3\noffload_optimizer: false\n")  # a real YAML boolean is fine
  assert ZeroConfig.from_file(y).offload_optimizer is False


@pytest.mark.parametrize("name, text, match", [
    ("empty.yaml", "", r"'.*empty\.yaml' is empty"),
    ("comments.yaml", "# nothing here\n---\n", r"'.*comments\.yaml' is empty"),
    ("empty.json", "  \n", r"'.*empty\.json' is empty"),
    ("list.yaml", "- 1\n- 2\n", r"'.*list\.yaml' must hold a mapping of settings, got list"),
    ("garbage.yaml", "stage: [2\nremat: }\n", r"'.*garbage\.yaml', line 2, column \d+: not "
     "valid YAML"),
    ("tab.yaml", "stage: 2\n\tremat: full\n", r"'.*tab\.yaml', line 2, column 1: not valid "
     "YAML: .*tab characters"),
    ("garbage.json", '{"stage": 2,}', r"'.*garbage\.json', line 1, column 13: not valid JSON"),
    ("dup.yaml", "stage: 2\nremat: full\nstage: 3\n", r"'.*dup\.yaml': key 'stage' is given "
     r"twice in one mapping \(lines 1 and 3\)"),
    ("dupnested.yaml", "train:\n  steps: 2\n  steps: 3\n", r"key 'steps' is given twice "
     r"in one mapping \(lines 2 and 3\)"),
    ("dup.json", '{"stage": 2, "stage": 3}', r"'.*dup\.json': key 'stage' is given twice"),
])
def test_bad_files_name_the_file(tmp_path, name, text, match):
  p = tmp_path / name
  p.write_text(text)
  with pytest.raises(ConfigError, match=match):
    ZeroConfig.from_file(p)


def test_empty_file_allowed_when_asked(tmp_path):
  p = tmp_path / "empty.yaml"
  p.write_text("")
  assert ZeroConfig.from_file(p, allow_empty=True) == ZeroConfig()


def test_yaml_merge_keys_are_not_duplicates(tmp_path):
  p = tmp_path / "merge.yaml"
  p.write_text("base: &b {stage: 2}\n")
  from zerojax.core.config import read_config_file
  assert read_config_file(p) == {"base": {"stage": 2}}
  p.write_text("a: &b {stage: 2, remat: full}\nb:\n  <<: *b\n  stage: 3\n")
  assert read_config_file(p)["b"] == {"stage": 3, "remat": "full"}


@pytest.mark.parametrize("field", ["gradient_clipping", "loss_scale", "min_loss_scale"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_numbers_are_refused(field, value):
  with pytest.raises(ConfigError, match=f"ZeroConfig.{field}={value!r} is invalid"):
    ZeroConfig.from_flat({field: value})


@pytest.mark.parametrize("text", ["Infinity", "NaN", "-Infinity"])
def test_non_finite_batch_size_in_json_names_the_key(tmp_path, text):
  p = tmp_path / "c.json"
  p.write_text('{"train_batch_size": %s}' % text)
  with pytest.raises(ConfigError, match=r"c\.json.*ZeroConfig.train_batch_size=.* is invalid"):
    ZeroConfig.from_file(p)


def test_bad_regex_in_rules_names_the_rule():
  with pytest.raises(ConfigError) as e:
    ZeroConfig(rules=(("embed", (None, "fsdp")), ("mlp/(kernel", ("fsdp", None))))
  msg = str(e.value)
  assert "ZeroConfig.rules[1]=('mlp/(kernel', ('fsdp', None)) is invalid" in msg
  assert "does not compile" in msg and "missing )" in msg


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
