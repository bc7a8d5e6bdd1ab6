"""Test setup: 8 simulated CPU devices, and shared (session-scoped) models and runs.

The device count must be set before JAX initialises its backend, so it happens at import.
Compiled steps and training runs are session fixtures: each stage is compiled and run once and
every test that needs it reads the cached result.
"""

import os

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
# The tests' programs are small and compiling them is most of the suite's time: LLVM's -O0 cuts
# it by a fifth. Buffer assignment, the collectives and elementwise arithmetic are XLA's, not
# LLVM's, so memory, HLO and bit-for-bit assertions read the same programs.
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for the whole run, its xdist workers and the subprocesses they
# start: tests build the same programs (a preset at a stage) from different closures, which
# JAX's in-memory cache cannot share, and XLA's key is the program itself.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  import tempfile
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="zerojax_test_jax_cache_")
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

import jax  # noqa: E402
import pytest  # noqa: E402

from tests import helpers  # noqa: E402


def pytest_configure(config):
  assert jax.device_count() == 8, "tests need 8 simulated CPU devices"


# Tests left out of the fast subset (`pytest -m "not slow"`), by node-id prefix: subprocess and
# multi-process runs, large models, compiled-memory bounds, and further variants of what the
# fast subset already covers. The fast subset keeps loss parity with the single-device run at
# every stage (test_step.py::test_parity_linen_scanned[0-3]) and the HLO/sharding checks on
# those runs; tests that share a cached run (tests/prec_helpers.py) are cut by the run, not one
# by one, since the first test to ask for a run pays for it. Listed here rather than decorated in each file, so that marking a test slow never
# touches a file others are editing. Durations measured with `pytest --durations=0`.
SLOW = (
    # ZeRO-Infinity: runs of 20 steps, other optimizers and the process kills
    "tests/test_nvme.py::test_nvme_bit_identical_to_in_memory_20_steps[1]",
    "tests/test_nvme.py::test_nvme_bit_identical_to_in_memory_20_steps[3]",
    "tests/test_nvme.py::test_nvme_bit_identical_with_accumulation_over_first_steps",
    "tests/test_nvme.py::test_nvme_with_clipping_matches_to_rounding",
    "tests/test_nvme.py::test_nvme_bit_identical_other_optimizers",
    "tests/test_nvme.py::test_nvme_state_moves_to_memory_and_back_exactly",
    "tests/test_nvme.py::test_nvme_killed_at_random_moments_resumes_exactly",
    "tests/test_accumulation.py::test_accumulation_equals_large_batch_step",
    "tests/test_accumulation.py::test_accumulation_one_gradient_reduction_per_step_stage01",
    "tests/test_accumulation.py::test_accumulation_reduce_scatters_each_micro_batch_stage23",
    "tests/test_accumulation.py::test_accumulation_memory_",
    "tests/test_checkpoint.py::test_checkpoint_exact_resume_in_new_process",
    "tests/test_checkpoint.py::test_checkpoint_stage3_8dev_to_stage1_4dev_and_back",
    "tests/test_checkpoint.py::test_checkpoint_restore_topology_matrix",
    "tests/test_checkpoint.py::test_checkpoint_killed_save_leaves_last_complete",
    "tests/test_checkpoint.py::test_checkpoint_export_command_line_one_device",
    "tests/test_checkpoint.py::test_checkpoint_export_peak_host_memory",
    "tests/test_cli.py::test_cli_train_deepspeed_config",
    "tests/test_cli.py::test_help[",
    "tests/test_cli.py::test_example_",
    "tests/test_clip.py::test_clip_grad_norm_equals_unsharded_norm",
    "tests/test_clip.py::test_clip_update_equals_optax_clip_chain",
    "tests/test_finetune.py::test_finetune_from_checkpoint_without_preset",
    "tests/test_hybrid.py::test_hybrid_parity_with_flat_mesh",
    "tests/test_hybrid.py::test_hybrid_shards_within_group_and_replicates_across",
    "tests/test_hybrid.py::test_hybrid_hlo_reduces_within_fsdp_group_then_across_replicas",
    "tests/test_hybrid.py::test_tensor_",
    "tests/test_loss_scaling.py::test_loss_scaling_forced_overflow_skips_step_bitwise",
    "tests/test_loss_scaling.py::test_loss_scaling_fp16_matches_unsharded_fp16",
    "tests/test_loss_scaling.py::test_loss_scaling_master_params_fp32_and_metrics_without_host_",
    "tests/test_loss_scaling.py::test_loss_scaling_learning_rate_metric",
    "tests/test_memory.py::test_memory_stage",
    "tests/test_memory.py::test_memory_max_live_layers_bounds_prefetch",
    "tests/test_memory.py::test_memory_persistent_matches_estimate",
    "tests/test_multiprocess.py::test_multiprocess_parity_with_one_process",
    "tests/test_multiprocess.py::test_multiprocess_hybrid_replica_spans_processes",
    "tests/test_multiprocess.py::test_multiprocess_each_process_feeds_its_own_rows",
    "tests/test_multiprocess.py::test_multiprocess_finetune_data_split_and_resume",
    "tests/test_multiprocess.py::test_multiprocess_checkpoint_restores_in_one_process",
    "tests/test_multiprocess.py::test_multiprocess_zerojax_checkpoint_restores_in_one_process",
    "tests/test_multiprocess.py::test_multiprocess_process_death_stops_the_survivor",
    "tests/test_multiprocess.py::test_multiprocess_launcher_fails_fast",
    "tests/test_multiprocess.py::test_multiprocess_unreachable_coordinator_is_a_clear_error",
    "tests/test_multiprocess.py::test_multiprocess_example_runs_under_the_launcher",
    "tests/test_offload.py::test_offload_parity_with_device_run",
    "tests/test_offload.py::test_offload_state_rests_in_pinned_host",
    "tests/test_offload.py::test_offload_hlo_has_host_transfers",
    "tests/test_offload.py::test_offload_device_bytes_drop_by_offloaded_bytes",
    "tests/test_offload.py::test_offload_remat_polic",
    "tests/test_precision.py::test_precision_bf16_matches_unsharded_bf16",
    "tests/test_precision.py::test_precision_master_params_and_optimizer_state_fp32",
    "tests/test_precision.py::test_precision_hlo_bf16_compute_and_bf16_gradient_reduction",
    "tests/test_precision.py::test_precision_plan_table_shows_dtypes",
    "tests/test_readme.py::test_readme_usage_snippet_runs_as_pasted_on_8_devices",
    "tests/test_reporting.py::test_training_run_that_shards_nothing_says_so",
    "tests/test_scale.py::test_scale_aot_compile_64_devices_memory_within_estimate",
    # ZeRO++: the fast subset keeps int8 qwZ+qgZ (parity, HLO dtypes, plan table) and the
    # exactness of the per-device formulation; these are its further variants.
    "tests/test_zeropp.py::test_quantised_training_tracks_the_unsharded_run[qwZ+qgZ int8, ",
    "tests/test_zeropp.py::test_quantised_training_tracks_the_unsharded_run[qwZ int8, ",
    "tests/test_zeropp.py::test_quantised_training_tracks_the_unsharded_run[qgZ ",
    "tests/test_zeropp.py::test_quantised_training_tracks_the_unsharded_run[qwZ+qgZ int4]",
    "tests/test_zeropp.py::test_hlo_moves_int8_where_the_switches_are_on[qwZ+qgZ int8, ",
    "tests/test_zeropp.py::test_hlo_moves_int8_where_the_switches_are_on[qwZ int8, ",
    "tests/test_zeropp.py::test_hlo_moves_int8_where_the_switches_are_on[qgZ ",
    "tests/test_zeropp.py::test_hlo_moves_int8_where_the_switches_are_on[qwZ+qgZ int4]",
    "tests/test_zeropp.py::test_quantised_backward_gathers_no_full_precision_weights",
    "tests/test_zeropp.py::test_shard_map_formulation_gives_the_exact_gradient[2-",
    "tests/test_zeropp.py::test_bf16_compute_gets_weights_dequantised_to_bf16",
    "tests/test_step.py::test_parity_vocab_50257_stage3",
    "tests/test_step.py::test_parity_linen_unscanned",
    "tests/test_step.py::test_parity_nnx",
    "tests/test_train.py::test_offload_config_trains",
    "tests/test_train.py::test_train_resume_equals_uninterrupted_run",
    "tests/test_train.py::test_train_runs_in_one_out_dir_never_mix",
    "tests/test_multiprocess.py::test_multiprocess_mismatch_fails_on_every_process",
    "tests/test_multiprocess.py::test_multiprocess_agreeing_processes_step",
    "tests/test_multiprocess.py::test_multiprocess_error_after_peer_death_exits_promptly",
    "tests/test_multiprocess.py::test_multiprocess_duplicate_process_id_gets_the_right_hint",
    "tests/test_nonfinite.py::test_loop_",
    "tests/test_nonfinite.py::test_nonfinite_step_is_skipped_bitwise[bfloat16]",
    "tests/test_nonfinite.py::test_nonfinite_ignore_applies_the_update",
    "tests/test_cli.py::test_estimate_fit_uses_the_compiled_peak",
    "tests/test_cli.py::test_estimate_fit_without_seq_uses_the_presets_length",
    "tests/test_reporting.py::test_train_reports_each_steps_own_throughput",
    "tests/test_memory_limit.py::test_nnx_step_over_the_limit_fails_before_it_runs",
    "tests/test_memory_limit.py::test_nothing_fits_says_so",
    "tests/test_nonfinite.py::test_halt_costs_no_memory",
    "tests/test_patterns.py::",
    "tests/test_llama.py::",
    "tests/test_tpu_aot.py::",
    "tests/test_first_hour.py::test_every_readme_python_snippet_runs_verbatim",
    "tests/test_first_hour.py::test_commands_on_shapes_start_only_the_cpu_backend",
    "tests/test_first_hour.py::test_train_bar_and_summary_print_the_same_tokens_per_sec",
    "tests/test_first_hour.py::test_estimate_stage3_peak_is_not_above_stage2",
    "tests/test_hf_finetune.py::test_finetune_end_to_end_",
)


def pytest_collection_modifyitems(config, items):
  slow = pytest.mark.slow
  for item in items:
    if item.nodeid.startswith(SLOW):
      item.add_marker(slow)


@pytest.fixture(scope="session")
def reference():
  """The unsharded single-device AdamW run of the tiny scanned GPT."""
  return helpers.reference_run(helpers.TINY)


@pytest.fixture(scope="session")
def zero_runs():
  """``{stage: Run}`` for the tiny scanned GPT on 8 devices, stages 0-3."""
  return {s: helpers.zero_run(helpers.TINY, s) for s in range(4)}
