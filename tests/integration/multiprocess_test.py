"""Ordered programs, all five futures and the patterns across two processes.

Two processes with 4 CPU devices each form one 8-device jax system
(`jax.distributed` on 127.0.0.1, a free port); the results must equal the
same programs run here in one process on 8 devices (examples/llama_4d.py's
plans: the model as one program, which each plan equals in one process,
llama_4d_test.py). In the two processes the
first jax_overlap call is an ordered program compiled inside `jax.set_mesh`.
Both processes are
stopped on any failure or timeout; none is left behind.
"""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys

import numpy as np
import pytest

import multiprocess_programs

WORKER = pathlib.Path(__file__).resolve().parent / "multiprocess_worker.py"
TIMEOUT_S = 600


def _free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _run_two_processes(out: pathlib.Path, programs: str = "run_all") -> None:
  port = _free_port()
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  # Of XLA_FLAGS only the LLVM optimization level (tests/conftest.py's -O0:
  # the same HLO, a cheaper compile) goes on; each process sets its devices.
  kept = [f for f in env.pop("XLA_FLAGS", "").split()
          if f.startswith("--xla_backend_optimization_level")]
  if kept:
    env["XLA_FLAGS"] = " ".join(kept)
  procs = [subprocess.Popen([sys.executable, str(WORKER), str(i), str(port),
                             str(out), programs], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
           for i in range(2)]
  logs = ["", ""]
  try:
    for i, p in enumerate(procs):
      logs[i], _ = p.communicate(timeout=TIMEOUT_S)
  except subprocess.TimeoutExpired:
    pytest.fail(f"the two processes did not finish in {TIMEOUT_S} s")
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  for i, p in enumerate(procs):
    assert p.returncode == 0, f"process {i} failed:\n{logs[i][-4000:]}"


@pytest.fixture(scope="module")
def two_process_results(tmp_path_factory):
  out = tmp_path_factory.mktemp("multiprocess") / "results.npz"
  _run_two_processes(out)
  with np.load(out) as data:
    return dict(data)


@pytest.fixture(scope="module")
def one_process_results():
  return multiprocess_programs.run_all()


@pytest.mark.subprocess
def test_same_programs(two_process_results, one_process_results):
  assert sorted(two_process_results) == sorted(one_process_results)


@pytest.mark.parametrize("name", [
    f"{c}/{k}" for c in ("all_gather", "psum", "psum_scatter", "all_to_all",
                         "ppermute") for k in ("value", "grad")] + [
    "fsdp/loss", "fsdp/grad_x", "fsdp/grad_w1", "fsdp/grad_w2"] + [
    f"fsdp_explicit/{k}" for k in ("loss", "grad_x", "grad_w1", "grad_w2")] + [
    "ordered/value", "ordered/grad_x", "ordered/grad_w"] + [
    f"{c}/{k}" for c in ("all_gather_matmul", "matmul_reduce_scatter")
    for k in ("value", "grad_x", "grad_w")])
@pytest.mark.subprocess
def test_two_processes_equal_one(name, two_process_results, one_process_results):
  got, want = two_process_results[name], one_process_results[name]
  assert got.shape == want.shape, (got.shape, want.shape)
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-5 * (np.abs(want).max() or 1))


#: plan -> the multiprocess_programs function that runs it
LLAMA_PROGRAMS = {"pp_fsdp_tp": "run_llama_4d", "pp_dp_tp": "run_llama_4d_psum",
                  "pp_fsdp_cp": "run_llama_4d_ring",
                  "pp_fsdp_ep": "run_llama_4d_experts"}


@pytest.fixture(scope="module", params=sorted(LLAMA_PROGRAMS))
def llama_4d_two_processes(request, tmp_path_factory):
  out = tmp_path_factory.mktemp("multiprocess_llama") / "results.npz"
  _run_two_processes(out, LLAMA_PROGRAMS[request.param])
  with np.load(out) as data:
    return request.param, dict(data)


# examples/llama_4d.py's four plans with 'pp' across the two processes (their
# stage sends cross them; fsdp's gathers, tp's rings, matmul_psum's sums, cp's
# rotations and ep's exchanges stay in one). The older jax run the first two
# (each plan is about 80 s of a CI lane).
@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.newest_jax(older_jax=[
    "test_llama_4d_across_two_processes_equals_one[pp_fsdp_tp]",
    "test_llama_4d_across_two_processes_equals_one[pp_dp_tp]"])
def test_llama_4d_across_two_processes_equals_one(llama_4d_two_processes):
  plan_name, got_all = llama_4d_two_processes
  # against the model as one program (the plan in one process equals it:
  # llama_4d_test.py); compiling the plan again here cost 47-56 s a plan
  want = multiprocess_programs.single_program_llama_4d(plan_name)
  assert sorted(got_all) == sorted(want)
  # the loss and every leaf's gradient
  assert len(want) == 1 + multiprocess_programs.llama_4d_leaves(plan_name)
  for name, got in got_all.items():
    np.testing.assert_allclose(got, want[name], rtol=1e-5, atol=1e-6, err_msg=name)
