"""benchmarks/gpu_check.py: its --dry-run (every part at tiny shapes on one CPU device, in its
own subprocess) writes the JSON and markdown it will write on a GPU, and what it measures
holds together. The GPU figures themselves need a GPU; on CPU they are null with a reason."""

import json
import math
import os
import subprocess
import sys

import pytest

from zerojax.runtime import gpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_check.py")
STATUSES = {"ok", "failed", "oom", "timeout", "skipped"}


def _run(out, *extra, timeout=900):
  p = subprocess.run([sys.executable, SCRIPT, "--dry-run", "--out", str(out), *extra],
                     capture_output=True, text=True, timeout=timeout, cwd=ROOT)
  assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
  with open(out / "results.json") as f:
    return json.load(f)


@pytest.fixture(scope="module")
def dry(tmp_path_factory):
  out = tmp_path_factory.mktemp("gpu_check")
  return _run(out), out


def _finite(xs):
  return len(xs) > 0 and all(math.isfinite(x) for x in xs)


# zerojax compiles for GPU topologies where it finds JAX's CUDA plugin (zerojax.runtime.gpu).
CAN_PREDICT = gpu.cuda_plugin() is not None
PREDICT = ("predict_stages01", "predict_stage2", "predict_stage3_edge")


@pytest.mark.slow
def test_every_part_is_recorded_and_the_device_parts_ran(dry):
  res, out = dry
  parts = res["parts"]
  for key in ("speed", "memory_stage0", "memory_stage1", "memory_stage2", "offload_optimizer",
              "offload_params", "nvme", *PREDICT, "edge_fit", "edge_next"):
    assert key in parts, key
    assert parts[key]["status"] in STATUSES
    if parts[key]["status"] != "ok":
      assert parts[key]["why"], key
  for key in ("speed", "memory_stage0", "memory_stage1", "memory_stage2", "offload_optimizer",
              "offload_params", "nvme"):
    assert parts[key]["status"] == "ok", (key, parts[key].get("why"), parts[key].get("log_tail"))
  assert res["environment"]["dry_run"] and res["complete"] and res["wall_s"] <= res["budget_s"]
  assert {f"{k}.log" for k in parts if parts[k]["status"] != "skipped"} <= set(
      os.listdir(out / "logs"))  # each part's own output, for reading a GPU run afterwards
  md = (out / "results.md").read_text()
  for head in ("## a. Speed", "## b. Memory", "## c. Offload", "## d. ZeRO-Infinity",
               "## e. The verdict's edge", "| stage | predicted peak"):
    assert head in md


@pytest.mark.slow
def test_speed_compares_the_same_model_and_data(dry):
  sp = dry[0]["parts"]["speed"]["result"]
  z, h = sp["zerojax"], sp["hand_written"]
  assert _finite(z["losses"]) and _finite(h["losses"])
  assert len(z["losses"]) == len(h["losses"]) == sp["steps"]
  # The same initial parameters and batch: the first loss is the same computation.
  assert z["losses"][0] == pytest.approx(h["losses"][0], rel=1e-6)
  assert sp["step_time_ratio"] == pytest.approx(z["step_s"] / h["step_s"])
  assert z["tokens_per_s"] == pytest.approx(sp["rows"] * sp["seq"] / z["step_s"])
  assert z["mfu"] is None and sp["peak_flops"] is None  # CPU: no named peak, no made-up MFU


@pytest.mark.slow
def test_memory_three_ways(dry):
  res = dry[0]
  for st in range(3):
    r = res["parts"][f"memory_stage{st}"]["result"]
    a = r["memory_analysis"]
    assert a["peak"] == a["argument"] + a["output"] - a["alias"] + a["temp"] > 0
    assert _finite(r["losses"])
    # CPU has no allocator statistics: null with the reason, never a number.
    assert r["memory_stats"]["peak_bytes_in_use"] is None and r["memory_stats"]["why"]
  mem = res["summary"]["memory"]
  assert mem["stage3"]["analysis_peak"] == \
      res["parts"]["speed"]["result"]["zerojax"]["memory_analysis"]["peak"]
  if all(res["parts"][k]["status"] == "ok" for k in PREDICT):
    for st in range(4):
      row = mem[f"stage{st}"]
      assert row["predicted_peak"] > 0 and row["predicted_fits"] is True
      assert row["predicted_over_analysis"] == pytest.approx(
          row["predicted_peak"] / row["analysis_peak"])
  else:
    assert not CAN_PREDICT, [res["parts"][k] for k in PREDICT]


@pytest.mark.slow
def test_offload_leaves_the_device_and_keeps_the_losses(dry):
  res = dry[0]
  for key, params_off in (("offload_optimizer", False), ("offload_params", True)):
    r = res["parts"][key]["result"]
    kinds = r["state_kinds_after"]
    assert "pinned_host" in kinds["opt_state"]
    assert set(kinds["params"]) == ({"pinned_host"} if params_off else {"device"})
    row = res["summary"]["offload"][key]
    host = r["state_kinds"]["opt_state"]["pinned_host"] + (
        r["state_kinds"]["params"].get("pinned_host", 0))
    assert row["offloaded_bytes"] == host > 0
    assert _finite(r["losses"])
    assert row["losses_equal"] and row["losses_compared"] == len(r["losses"])
    assert r["link"]["h2d_gb_s"] > 0 and r["link"]["d2h_gb_s"] > 0


@pytest.mark.slow
def test_nvme_bound_fields_are_consistent(dry):
  r = dry[0]["parts"]["nvme"]["result"]
  b = r["bound"]
  assert _finite(r["losses"])
  assert b["bound_bytes"] == int(1.1 * (b["param_bytes"] + b["grad_shard_bytes"]
                                        + b["buffer_pool_bytes"]))
  # bf16 parameters and gradients on the device; float32 master, mu and nu on disk.
  assert b["param_bytes"] == b["grad_shard_bytes"] == 2 * b["params"]
  assert b["state_on_disk_bytes"] == 12 * b["params"] <= b["files_bytes"]
  assert b["disk_over_bound"] == pytest.approx(b["state_on_disk_bytes"] / b["bound_bytes"])
  assert b["rss_peak_above_baseline"] == r["rss_peak_steady"] - r["rss_baseline"]
  assert r["rss_peak"] >= r["rss_peak_steady"]
  assert b["holds"] == (b["rss_peak_above_baseline"] <= b["bound_bytes"])
  assert set(b["param_kinds"]) == {"device"}
  h, dd = r["host_update"], r["dd"]
  assert h["bytes_read"] == h["bytes_written"] == b["state_on_disk_bytes"]
  assert h["read_mb_s"] > 0 and h["write_mb_s"] > 0
  assert dd["read_mb_s"] is not None or dd["read_error"]
  assert not os.path.exists(os.path.join(ROOT, ".gpu-check-nvme"))  # its files are removed


@pytest.mark.slow
def test_the_verdicts_edge(dry):
  res = dry[0]
  if res["parts"]["predict_stage3_edge"]["status"] != "ok":
    assert not CAN_PREDICT, res["parts"]["predict_stage3_edge"]
    assert res["parts"]["edge_fit"]["status"] == "skipped"
    return
  edge = res["parts"]["predict_stage3_edge"]["result"]["edge"]
  fit, nxt = edge["largest_fitting"], edge["first_refused"]
  assert nxt == fit + 1
  by_rows = {t["rows"]: t for t in edge["tried"]}
  assert by_rows[fit]["fits"] and by_rows[fit]["peak"] <= edge["usable_bytes"]
  assert not by_rows[nxt]["fits"] and by_rows[nxt]["peak"] > edge["usable_bytes"]
  for key, rows in (("edge_fit", fit), ("edge_next", nxt)):
    r = res["parts"][key]["result"]
    assert r["rows"] == rows and r["ran"] and _finite(r["losses"])
  assert res["summary"]["edge"]["fit_ran"]


def test_a_failing_part_is_recorded_and_the_run_goes_on(tmp_path):
  blocked = tmp_path / "file"
  blocked.write_text("")  # a file where the NVMe directory should be: the part fails
  res = _run(tmp_path / "out", "--parts", "nvme", "--nvme-dir", str(blocked / "nvme"),
             timeout=300)
  nv = res["parts"]["nvme"]
  assert nv["status"] == "failed" and "NotADirectoryError" in nv["why"], nv
  assert res["complete"] and "NotADirectoryError" in (tmp_path / "out" / "logs" / "nvme.log"
                                                      ).read_text()
  assert "## d. ZeRO-Infinity" in (tmp_path / "out" / "results.md").read_text()


def test_the_time_budget_kills_and_skips(tmp_path):
  res = _run(tmp_path, "--parts", "memory", "--budget", "6", timeout=300)
  parts = res["parts"]
  assert parts["memory_stage0"]["status"] in {"timeout", "ok"}
  assert any(parts[f"memory_stage{s}"]["status"] in {"timeout", "skipped"} for s in range(3))
  assert all(parts[f"memory_stage{s}"].get("why") for s in range(3)
             if parts[f"memory_stage{s}"]["status"] != "ok")
