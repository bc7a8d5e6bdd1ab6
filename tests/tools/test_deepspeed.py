"""DeepSpeed ds_config.json -> ZeroConfig, key by key."""

import json
import pathlib

import pytest

import zerojax
from zerojax.tools import deepspeed as ds
from zerojax.core.config import ConfigError

ROOT = pathlib.Path(__file__).resolve().parents[2]

FULL = {
    "train_batch_size": 64,
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "steps_per_print": 7,
    "wall_clock_breakdown": False,
    "bf16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-8,
                                              "weight_decay": 0.01}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-4,
                                                 "warmup_num_steps": 10}},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu"},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": 5e8,
        "allgather_bucket_size": 2e8,
        "stage3_prefetch_bucket_size": 5e7,
        "stage3_param_persistence_threshold": 1e5,
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "sub_group_size": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
}


def _note(m, key):
  hits = [n for n in m.notes if n.startswith(key + ":")]
  assert len(hits) == 1, (key, m.notes)
  return hits[0]


def test_full_config_key_by_key():
  m = ds.map_deepspeed(FULL)
  c = m.config
  # zero_optimization
  assert c.stage == 3
  assert c.offload_optimizer is True and c.offload_params is True
  assert c.param_persistence_threshold == 100_000
  assert c.max_live_layers == 2  # prefetch bucket > 0: next layer's gather may overlap
  # batch sizes, clipping, precision
  assert (c.train_batch_size, c.micro_batch_per_device, c.gradient_accumulation_steps) == (64, 4, 2)
  assert c.batch_sizes(8) == (64, 4, 2)
  assert c.gradient_clipping == 1.0
  assert c.compute_dtype == "bfloat16" and c.param_dtype == "float32"
  assert c.loss_scale is None
  # keys whose job XLA does -> flags, with the byte conversion (float32 elements)
  assert m.xla_flags == (
      "--xla_gpu_reduce_scatter_combine_threshold_bytes=2000000000",
      "--xla_gpu_all_reduce_combine_threshold_bytes=2000000000",
      "--xla_gpu_all_gather_combine_threshold_bytes=800000000",
      "--xla_gpu_enable_latency_hiding_scheduler=true",
  )
  assert "--xla_gpu_enable_latency_hiding_scheduler=true" in _note(
      m, "zero_optimization.overlap_comm")
  assert "2000000000" in _note(m, "zero_optimization.reduce_bucket_size")
  # accepted keys with no XLA meaning: one note each
  for key in ("contiguous_gradients", "stage3_max_reuse_distance", "sub_group_size",
              "stage3_max_live_parameters", "stage3_gather_16bit_weights_on_model_save",
              "offload_optimizer.pin_memory"):
    assert _note(m, f"zero_optimization.{key}")
  assert "XLA allocates" in _note(m, "zero_optimization.contiguous_gradients")
  assert _note(m, "wall_clock_breakdown")
  # training-loop settings
  assert m.train["optimizer"] == {"name": "adamw", "lr": 1e-4, "betas": [0.9, 0.95],
                                  "eps": 1e-8, "weight_decay": 0.01}
  assert m.train["scheduler"]["name"] == "WarmupLR"
  assert m.train["log_every"] == 7
  assert "XLA flags set:" in m.summary()


def test_one_loader_for_deepspeed_files_keeps_everything(tmp_path):
  p = tmp_path / "ds_config.json"
  p.write_text(json.dumps(FULL))
  loaded = zerojax.load_config(p, apply_xla_flags=False)
  m = ds.map_deepspeed(FULL)
  assert loaded.deepspeed and loaded.config == m.config
  assert loaded.xla_flags == list(m.xla_flags) and loaded.train["log_every"] == 7
  # ZeroConfig.from_file reads zerojax files only: a DeepSpeed file is sent to the loader
  # rather than losing its XLA flags and training options.
  with pytest.raises(zerojax.ConfigError, match="zerojax.load_config"):
    zerojax.ZeroConfig.from_file(p)
  with pytest.raises(zerojax.ConfigError, match="zerojax.load_config"):
    zerojax.ZeroConfig.from_dict(FULL)
  assert ds.load_deepspeed(p).xla_flags == m.xla_flags


def test_fp16_dynamic_and_static_loss_scale():
  d = {"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12,
                "loss_scale_window": 100, "hysteresis": 3, "min_loss_scale": 2},
       "zero_optimization": {"stage": 1}}
  c = ds.from_deepspeed(d)
  assert c.compute_dtype == "float16" and c.loss_scale.scale == 0.0 and c.loss_scale.dynamic
  assert (c.initial_scale_power, c.loss_scale_window, c.hysteresis, c.min_loss_scale) == (
      12, 100, 3, 2.0)
  d["fp16"]["loss_scale"] = 128
  assert ds.from_deepspeed(d).loss_scale.scale == 128.0
  d["fp16"]["enabled"] = False
  assert ds.from_deepspeed(d).loss_scale is None


def test_communication_dtype_halves_bucket_bytes():
  m = ds.map_deepspeed({"communication_data_type": "bf16",
                        "zero_optimization": {"stage": 2, "reduce_bucket_size": 1000,
                                              "overlap_comm": False}})
  assert m.config.reduce_dtype == "bfloat16"
  assert "--xla_gpu_reduce_scatter_combine_threshold_bytes=2000" in m.xla_flags
  assert "--xla_gpu_enable_latency_hiding_scheduler=false" in m.xla_flags


def test_defaults_and_auto_values():
  m = ds.map_deepspeed({"train_batch_size": "auto", "gradient_clipping": "auto",
                        "bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 2}})
  c = m.config
  # the HF Trainer's defaults (#51): max_grad_norm 1.0, neither bf16 nor fp16
  assert c.stage == 2 and c.train_batch_size is None and c.gradient_clipping == 1.0
  assert c.compute_dtype == "float32"
  assert _note(m, "train_batch_size") and _note(m, "bf16.enabled")
  assert ds.from_deepspeed({"zero_optimization": {}}).stage == 0  # DeepSpeed's default
  assert ds.from_deepspeed({"gradient_clipping": 0, "zero_optimization": {}}).gradient_clipping \
      is None


def test_hpz_maps_to_hybrid_mesh():
  c = ds.from_deepspeed({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 8}})
  assert c.mesh_shape == (-1, 8) and c.mesh_axes == ("replica", "fsdp")


def test_zerojax_section_sets_other_fields():
  c = ds.from_deepspeed({"zero_optimization": {"stage": 3},
                         "zerojax": {"remat": "full", "max_live_layers": 1}})
  assert c.remat.policy == "full" and c.gather.max_live_layers == 1
  # a policy as a section replaces what DeepSpeed's sections mapped to
  c = ds.from_deepspeed({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
                         "zerojax": {"offload": {"kind": "host", "fallback": "warn"}}})
  assert c.offload == zerojax.HostOffload(optimizer=True, fallback="warn")


@pytest.mark.parametrize("d, names", [
    ({"zero_optimization": {"stage": 2}, "train_bach_size": 8}, "'train_bach_size'"),
    ({"zero_optimization": {"stage": 2, "overlap_com": True}}, "'overlap_com'"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_mem": 1}}},
     "'pin_mem'"),
    ({"zero_optimization": {"stage": 1}, "fp16": {"enabled": True, "scale": 1}}, "'scale'"),
    ({"zero_optimization": {"stage": 1}, "zerojax": {"stag": 1}}, "'stag'"),
])
def test_unknown_key_is_an_error_naming_it(d, names):
  with pytest.raises(ConfigError, match="unknown DeepSpeed config key " + names):
    ds.map_deepspeed(d)


# offload_optimizer: tests/runtime/test_nvme.py
@pytest.mark.parametrize("which", ["offload_param"])
def test_nvme_says_what_to_use_instead(which):
  with pytest.raises(ConfigError) as e:
    ds.map_deepspeed({"zero_optimization": {"stage": 3, which: {"device": "nvme",
                                                                 "nvme_path": "/x"}}})
  msg = str(e.value)
  assert f"zero_optimization.{which}.device" in msg and "'nvme'" in msg
  assert '"device": "cpu"' in msg


@pytest.mark.parametrize("d, match", [
    ({"zero_optimization": {"stage": 4}}, r"zero_optimization.stage'=4.*0, 1, 2 or 3"),
    ({"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}, "fp16": {"enabled": True}},
     "both 'bf16' and 'fp16'"),
    ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
     r"key 'zero_optimization.offload_param'=\{'device': 'cpu'\} is invalid: needs stage 3.*"
     r"\(it sets ZeroConfig.offload.params=True\)"),
    ({"zero_optimization": {"stage": 2, "zero_quantized_weights": True}},
     r"key 'zero_optimization.zero_quantized_weights'=True is invalid: needs stage 3.*"
     r"ZeroConfig.quantize.weights='int8'"),
    ({"zero_optimization": {"stage": 1, "zero_quantized_gradients": True}},
     r"key 'zero_optimization.zero_quantized_gradients'=True is invalid: needs stage 2 or 3"),
    ({"zero_optimization": {"stage": 3, "zero_quantized_nontrainable_weights": True}},
     "frozen weights"),
    ({"zero_optimization": {"stage": 2, "reduce_bucket_size": -1}}, "reduce_bucket_size"),
    ({"zero_optimization": {"stage": 2}, "optimizer": {"type": "Adafactor"}}, "Adafactor"),
])
def test_invalid_values(d, match):
  with pytest.raises(ConfigError, match=match):
    ds.map_deepspeed(d)


def test_each_section_becomes_its_policy():
  """#54: DeepSpeed's sections map onto zerojax's policies one to one, and each note names
  the policy field it set."""
  c = ds.map_deepspeed(FULL).config
  assert c.precision == zerojax.Precision(compute="bfloat16")
  assert c.offload == zerojax.HostOffload(optimizer=True, params=True)
  assert c.gather == zerojax.Gather(max_live_layers=2, persistence_threshold=100_000)
  assert c.batch == zerojax.Batch(global_size=64, micro_per_device=4, accumulation_steps=2)
  assert c.quantize is None and c.loss_scale is None
  # offload_param alone keeps the optimizer state on the devices
  m = ds.map_deepspeed({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}})
  assert m.config.offload == zerojax.HostOffload(optimizer=False, params=True)
  assert _note(m, "zero_optimization.offload_param") == (
      "zero_optimization.offload_param: device cpu -> offload.params=True (HostOffload: "
      "pinned_host memory)")
  m = ds.map_deepspeed({"fp16": {"enabled": True, "loss_scale_window": 50, "min_loss_scale": 4},
                        "communication_data_type": "bf16",
                        "zero_optimization": {"stage": 3, "zero_quantized_gradients": True}})
  assert m.config.precision == zerojax.Precision(compute="float16", reduce="bfloat16")
  assert m.config.loss_scale == zerojax.LossScale(window=50, min_scale=4.0)
  assert m.config.quantize == zerojax.Quantize(gradients="int8")
  assert "quantize.gradients='int8'" in _note(m, "zero_optimization.zero_quantized_gradients")
  assert _note(m, "communication_data_type").endswith("precision.reduce='bfloat16'")


@pytest.mark.parametrize("d, match", [
    # a value ZeroConfig refuses is named by the DeepSpeed key that set it
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                            "offload_optimizer": {"device": "nvme", "nvme_path": "/n"}}},
     r"^DeepSpeed config key 'zero_optimization.offload_param'=\{'device': 'cpu'\} is invalid: "
     r"cannot be combined with zero_optimization.offload_optimizer on nvme"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme",
                                                              "nvme_path": "/n"},
                            "cpu_offload": True}},
     r"^DeepSpeed config key 'zero_optimization.cpu_offload'=True is invalid: conflicts with"),
    # and one the "zerojax" section sets, by its key there
    ({"zero_optimization": {"stage": 3}, "zerojax": {"precision": {"compute": "fp8"}}},
     r"^DeepSpeed config key 'zerojax.precision.compute'='fp8' is invalid: allowed dtypes"),
    ({"zero_optimization": {"stage": 3}, "zerojax": {"compute_dtype": "fp8"}},
     r"^DeepSpeed config key 'zerojax.compute_dtype'='fp8' is invalid: allowed dtypes.*"
     r"\(it sets ZeroConfig.precision.compute='fp8'\)$"),
    ({"zero_optimization": {"stage": 3}, "zerojax": {"offload": {"kind": "host",
                                                                  "optimizer": False}}},
     r"^DeepSpeed config key 'zerojax.offload.optimizer'=False is invalid: HostOffload moves "
     r"nothing"),
    ({"zero_optimization": {"stage": 3}, "zerojax": {"offload": {"kind": "disk"}}},
     r"^DeepSpeed config maps to an invalid ZeroConfig: ZeroConfig.offload.kind='disk'"),
])
def test_refused_values_name_the_key_that_set_them(d, match):
  with pytest.raises(ConfigError, match=match):
    ds.map_deepspeed(d)


def test_zeropp_keys_map_to_quantised_collectives():
  m = ds.map_deepspeed({"zero_optimization": {"stage": 3, "zero_quantized_weights": True,
                                              "zero_quantized_gradients": True,
                                              "zero_hpz_partition_size": 4}})
  c = m.config
  assert (c.quantize_weights, c.quantize_gradients) == ("int8", "int8")
  # DeepSpeed's qwZ quantises every parameter all-gather, the backward pass's fetches included.
  assert c.mesh_axes == ("replica", "fsdp") and c.quantizes_backward
  notes = dict(n.split(": ", 1) for n in m.notes)
  assert "qwZ" in notes["zero_optimization.zero_quantized_weights"]
  assert "qgZ" in notes["zero_optimization.zero_quantized_gradients"]
  off = ds.map_deepspeed({"zero_optimization": {"stage": 3, "zero_quantized_weights": False}})
  assert off.config.quantize_weights is None


def test_apply_xla_flags_keeps_user_flags():
  m = ds.map_deepspeed(FULL)
  env = {"XLA_FLAGS": "--xla_gpu_enable_latency_hiding_scheduler=false"}
  added = m.apply_xla_flags(env)
  assert "--xla_gpu_enable_latency_hiding_scheduler=true" not in added
  assert len(added) == 3
  assert env["XLA_FLAGS"].startswith("--xla_gpu_enable_latency_hiding_scheduler=false ")
  assert m.apply_xla_flags(env) == []  # idempotent


def test_shipped_configs_load():
  from zerojax import load_config
  files = sorted((ROOT / "configs").glob("*.*"))
  assert any(f.name.startswith("ds_") for f in files) and any(f.suffix == ".yaml" for f in files)
  for f in files:  # (ds_zero2.json's "auto" values need the run's lr and compute_dtype to train:
    # tests/tools/test_first_hour.py)
    loaded = load_config(f, apply_xla_flags=False, for_training=False)
    assert loaded.config.stage in (0, 1, 2, 3), f
    assert loaded.deepspeed == f.name.startswith("ds_"), f


# -- wrong types, aliases, non-finite numbers (issue 15 item 2) ---------------------------------


@pytest.mark.parametrize("d, match", [
    ({"zero_optimization": []}, r"'zero_optimization'=\[\] is invalid: a mapping"),
    ({"zero_optimization": {"stage": 2}, "bf16": []}, r"'bf16'=\[\] is invalid: a mapping"),
    ({"zero_optimization": {"stage": 2}, "fp16": False}, r"'fp16'=False is invalid"),
    ({"zero_optimization": {"stage": 2}, "bf16": {"enabled": False},
      "bfloat16": {"enabled": True}}, "both 'bf16'.* and 'bfloat16'.*aliases"),
    ({"zero_optimization": {"stage": 2}, "bf16": {"enabled": "false"}},
     r"'bf16.enabled'='false' is invalid: true or false"),
    ({"zero_optimization": {"stage": 2, "cpu_offload": "false"}},
     r"'zero_optimization.cpu_offload'='false' is invalid: true or false"),
    ({"zero_optimization": {"stage": 2, "overlap_comm": "false"}},
     r"'zero_optimization.overlap_comm'='false' is invalid"),
    ({"zero_optimization": {"stage": 2}, "tensorboard": {"enabled": "false"}},
     r"'tensorboard.enabled'='false' is invalid: true or false"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": False}}},
     r"'zero_optimization.offload_optimizer.device'=False is invalid"),
    ({"zero_optimization": {"stage": 2}, "train_batch_size": float("inf")},
     r"'train_batch_size'=inf is invalid: an integer"),
    ({"zero_optimization": {"stage": 2}, "train_batch_size": float("nan")},
     r"'train_batch_size'=nan is invalid: an integer"),
    ({"zero_optimization": {"stage": 2}, "gradient_clipping": float("inf")},
     r"'gradient_clipping'=inf is invalid: a finite number"),
    ({"zero_optimization": {"stage": 2}, "zerojax": {"offload_optimizer": "false"}},
     r"key 'zerojax.offload_optimizer'='false' is invalid: true or false"),
    ({"zero_optimization": {"stage": 2}, "zerojax": ["remat", "full"]},
     r"'zerojax'=\['remat', 'full'\] is invalid: a mapping"),
])
def test_wrong_types_are_errors(d, match):
  with pytest.raises(ConfigError, match=match):
    ds.map_deepspeed(d)


def test_offload_device_strings_map_explicitly():
  on = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                              "offload_param": {"device": "CPU"}}}
  c = ds.map_deepspeed(on).config
  assert c.offload_optimizer is True and c.offload_params is True
  for device in ("none", "auto", "None"):
    m = ds.map_deepspeed({"zero_optimization": {"stage": 3, "offload_optimizer":
                                                {"device": device}}})
    assert m.config.offload_optimizer is False
  m = ds.map_deepspeed({"zero_optimization": {"stage": 3, "offload_param": {"device": "auto"}}})
  assert m.config.offload_params is False
  assert any("offload_param.device: 'auto'" in n for n in m.notes)


def test_null_sections_mean_not_set():
  c = ds.map_deepspeed({"zero_optimization": {"stage": 1}, "bf16": None, "fp16": None}).config
  assert c.compute_dtype == "float32" and c.stage == 1


def test_bfloat16_alias_alone_still_works():
  c = ds.map_deepspeed({"zero_optimization": {"stage": 1}, "bfloat16": {"enabled": True}}).config
  assert c.compute_dtype == "bfloat16"


def test_unknown_key_suggests_the_closest():
  with pytest.raises(ConfigError, match=r"unknown DeepSpeed config key 'stgae' in "
                     r"'zero_optimization' \(did you mean 'stage'\?\)"):
    ds.map_deepspeed({"zero_optimization": {"stgae": 2}})
  with pytest.raises(ConfigError, match=r"'train_batch_sise' \(did you mean "
                     r"'train_batch_size'\?\)"):
    ds.map_deepspeed({"zero_optimization": {"stage": 2}, "train_batch_sise": 8})


def test_load_deepspeed_names_the_file(tmp_path):
  p = tmp_path / "ds.json"
  p.write_text('{"zero_optimization": {"stage": 2, "stage": 3}}')
  with pytest.raises(ConfigError, match=r"ds\.json': key 'stage' is given twice"):
    ds.load_deepspeed(p)
  p.write_text('{"zero_optimization": {"stage": 2, "overlap_comm": "yes"}}')
  with pytest.raises(ConfigError, match=r"config file '.*ds\.json': DeepSpeed config key "
                     r"'zero_optimization.overlap_comm'='yes' is invalid"):
    ds.load_deepspeed(p)
