"""Test-session setup. libtpu is installed (for AOT TPU compiles), but this machine has no TPU:
pin the runtime to CPU before jax is imported so it does not probe for one. Topology
descriptions for ahead-of-time compilation still work under this setting."""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# libtpu takes a machine-wide lock file by default; a second process compiling for TPU at the same
# time (another test run, a benchmark) would fail on it. Compiling needs no exclusive device.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# One persistent compilation cache for the session, inherited by every subprocess: the suite
# starts train.py, eval.py and the multi-device programs many times on the same tiny models, and
# each would compile the same executables again (the results do not depend on it).
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="gattn-test-jax-cache-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
# Every executable, however quick to compile: an eval.py run compiles ~20 small ones (0.5 s in all,
# 15% of the run), and the whole session's cache stays a few MB.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

from gattn.config import ModelConfig  # noqa: E402 (JAX-free: importing it here costs nothing)

# The tiny architecture most tests build: 2 layers, GQA 4 query heads over 2 kv heads, head_dim 8.
# A test that depends on other numbers passes them (tiny_model(vocab_size=96, head_dim=16)).
TINY_DIMS = dict(vocab_size=61, d_model=32, num_layers=2, q_heads=4, kv_heads=2, head_dim=8, d_ff=64)


def tiny_model(**changes) -> ModelConfig:
    """The shared tiny ModelConfig (TINY_DIMS) with `changes` (any ModelConfig field) applied.
    Tests import it (`from conftest import tiny_model`); so do the programs in tests/multidevice."""
    return ModelConfig(**{**TINY_DIMS, **changes})


def run_config_file(**train) -> str:
    """The text of a config file for end-to-end runs of train.py / eval.py: a tiny model on the
    embedded corpus, with `train` (TrainConfig fields: steps, warmup_steps, eval_every, ...)."""
    fields = ", ".join(f"{k}={v!r}" for k, v in {"batch_size": 4, "seq_len": 32, "log_every": 1, **train}.items())
    return (
        "from gattn.config import Config, DataConfig, ModelConfig, TrainConfig\n\n"
        "def get_config():\n"
        "    return Config(\n"
        "        model=ModelConfig(vocab_size=512, d_model=32, num_layers=2, q_heads=2, kv_heads=1,\n"
        "                          head_dim=16, d_ff=64),\n"
        f"        train=TrainConfig({fields}),\n"
        "        data=DataConfig(code_max_bytes=200_000, eval_batches=1, eval_batch_size=2))\n")


def entry_point(name: str):
    """train.py / eval.py as a module, to call its main() in the test's process (for checks that
    stop before any work, where an interpreter start would cost more than the check)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(f"entry_{name}", Path(__file__).resolve().parents[1] / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# End-to-end checks that run with `-m slow`, not in the default suite, which must stay near 12
# minutes on 2 slow cores (it took 34 minutes on such a machine with these in it). Each keeps a
# cheaper check of the same code in the default run, named after the "#".
SLOW_HERE = {
    "test_sharding.py::test_a_hybrid_shards_its_gdn_heads_and_equals_one_device":
        "60-100 s: 8 processes' worth of compiles",  # test_hybrid: the model itself; the dense mesh test
    "test_hybrid.py::test_the_tiny_hybrid_trains_and_resumes_bit_identically":
        "60-110 s: a run and a resume",  # test_hybrid's model checks; test_train's resume of a dense run
    "test_rehearse.py::test_a_small_rehearsal_passes_every_stage":
        "45 s",  # its stages: test_pod (processes), test_train (resume), test_eval (eval.py)
    "test_lm_eval.py::test_the_command_scores_a_converted_model_and_humaneval_with_the_opt_in":
        "35 s",  # test_gattn_equals_lm_evals_hf_backend_on_a_tiny_qwen3: the model class itself
    "test_study.py::test_study_runs_resumes_after_a_kill_and_reports_everything":  # test_main_job_trains_both...
        "74 s: a study of 4 cells, killed and resumed",
    "test_train.py::test_resume_refuses_another_model_and_continues_under_other_execution_settings":
        "71 s: three runs",  # test_rundir / test_cli config checks
    "test_aot.py::test_fit_compiles_train_and_eval_steps_at_the_real_global_batch":
        "58 s: a TPU compile at batch 1024",  # bench/fit_presets.py; test_loss's compiled memory
    "test_train.py::test_sigkill_then_resume_reproduces_the_uninterrupted_run":
        "48 s",  # test_rehearse's small rehearsal: kill-free resume on another layout
    "test_sharding.py::test_sharded_loss_and_gradients_equal_one_device":
        "45 s",  # test_train_step: microbatches on a 2x2x2 mesh equal one device
    "test_dropless_ep.py::test_dropless_expert_parallel_moe_equals_one_device":
        "45 s",  # test_grouped_matmul: megablox in the dropless layer on a 2x2x2 mesh
    "test_eval.py::test_ruler_with_yarn_and_a_table_5_comparison": "43 s",  # test_ruler unit tests
    "test_gpu_check.py::test_gpu_check_dry_run": "42 s",  # nothing here needs a GPU
    "test_expert_parallel.py::test_explicit_expert_parallel_moe_equals_one_device":
        "39 s",  # test_moe: the layer's own checks
    "test_model.py::test_pallas_attention_matches_xla_in_loss_and_gradients[sdpa_headwise]":
        "34 s",  # test_flash: the kernel against its reference
    "test_convert.py::test_eval_and_continued_training_on_a_converted_model":
        "33 s",  # test_convert: logit parity
    "test_train.py::test_moe_run_logs_its_auxiliary_losses": "32 s",  # test_moe: aux per layer
    "test_train.py::test_sigterm_saves_and_exits_cleanly": "31 s",  # the small rehearsal's SIGTERM stage
    "test_notebooks.py::test_prototype_notebook_runs": "29 s",  # the notebook's code is eval's
    "test_eval.py::test_eval_restores_onto_another_device_count": "29 s",  # the rehearsal's eval stage
    "test_train.py::test_divergence_stops_with_a_clear_message_and_finite_checkpoints":
        "24 s",  # test_optim: non-finite steps skipped
    "test_model.py::test_packed_loss_equals_the_loss_of_each_document_alone":
        "24 s",  # test_attention_reference: a packed row equals its documents
    "test_train_step.py::test_microbatches_of_a_moe_equal_the_plain_step_without_the_per_microbatch_lbl":
        "21 s",  # the dense microbatch test
    "test_eval.py::test_compare_prints_a_table_4_row_per_run_and_overlays_curves": "21 s",
    "test_train.py::test_continued_training_starts_from_another_runs_parameters":
        "21 s",  # test_init_from unit tests
    "test_model.py::test_bf16_compute_with_fp32_params_tracks_fp32": "20 s",
    "test_flash.py::test_bfloat16_values_and_gradients_match_reference": "17 s",  # the float32 cases
    "test_sharding.py::test_pallas_attention_runs_sharded_under_the_context_mesh": "17 s",
    "test_model.py::test_scan_over_layers_equals_the_layer_loop[none]": "16 s",  # the [full] case
    "test_flash.py::test_unequal_query_and_key_padding_matches_reference": "16 s",  # padding queries
    "test_flash.py::test_float32_values_and_gradients_match_reference[37-": "16 s",  # the small cases
    "test_flash.py::test_float32_values_and_gradients_match_reference[20-": "14 s",
    "test_flash.py::test_float32_values_and_gradients_match_reference[24-": "13 s",
    "test_flash.py::test_float32_values_and_gradients_match_reference[45-": "13 s",
    "test_analysis.py::test_m_act_and_gate_score_equal_direct_computations[None]": "15 s",  # [remat]
    "test_analysis.py::test_m_act_and_gate_score_equal_direct_computations[moe]": "11 s",
    "test_flash.py::test_shard_attention_over_batch_and_heads_matches_reference": "15 s",
    "test_eval.py::test_eval_refuses_an_architecture_change_and_keeps_the_results": "13 s",
    "test_decode.py::test_a_capacity_moe_decodes_dropless_and_each_row_as_it_would_alone": "10 s",
    "test_pod.py::test_two_processes_train_the_same_run_as_one":
        "76 s: two runs",  # test_cluster: processes joined, watched, stopped
    "test_grouped_matmul.py::test_megablox_in_the_dropless_layer_equals_one_device":
        "32 s",  # megablox against ragged_dot and a dense reference; the dropless layer's own test
    "test_eval.py::test_ungated_runs_report_gate_fields_as_absent_and_step_selects_a_checkpoint": "13 s",
    "test_model.py::test_scan_over_layers_equals_the_layer_loop": "15 s",  # test_moe: the scanned MoE
    "test_analysis.py::test_m_act_and_gate_score_equal_direct_computations[gate1]": "15 s",  # [remat]
    "test_analysis.py::test_m_act_and_gate_score_equal_direct_computations[gate2]": "14 s",
    "test_flash.py::test_float32_values_and_gradients_match_reference[32-": "13 s",
    "test_decode.py::test_chunked_prefill_equals_one_shot_prefill": "11 s",  # generate = no-cache
    "test_params.py::test_presets_work_after_a_plain_install_from_any_directory": "11 s",
    "test_analysis.py::test_an_expert_parallel_moe_is_measured_without_its_mesh": "10 s",
    "test_flash_gpu.py::test_gpu_kernel_matches_reference": "8 s each",  # nothing here needs a GPU
    "test_flash_gpu.py::test_cudnn_path_matches_reference_off_gpu": "7 s",
    "test_loss.py::test_chunked_loss_and_gradients_equal_the_plain_ones[6-True-bfloat16]":
        "17 s",  # the [4-False-float32] case: the chunked loss itself
    "test_optim.py::test_decay_mask_covers_every_kind_of_parameter[changes3-True]":
        "12 s",  # [changes3-False]: the MoE's parameters; the other [*-True]: scanned ones
}


def pytest_collection_modifyitems(config, items):
    import pytest

    for item in items:
        node = item.nodeid.split("tests/", 1)[-1]
        if any(node.startswith(prefix) for prefix in SLOW_HERE):
            item.add_marker(pytest.mark.slow)


# The compiles each test file makes in the test process (issue 59, docs/testing.md): with
# GATTN_COMPILE_COUNTS=PREFIX, each pytest process (each xdist worker) writes PREFIX.<worker>.json,
# {test file: [compiles, compile seconds]}, from JAX's backend-compile events, and under
# "(programs)" {program name: [compiles, seconds]} over all files (an eager op compiles one program
# per shape: jit(_randint), jit(multiply), ...). Programs a test starts (train.py, the
# multi-device scripts) compile in their own processes and are not counted.
_COMPILES: dict = {}
_PROGRAMS: dict = {}
_CURRENT = ["(collection)"]


def pytest_configure(config):
    if os.environ.get("GATTN_COMPILE_COUNTS"):
        import jax.monitoring

        def on_event(event, duration, fun_name="?", **_):
            if event == "/jax/core/compile/backend_compile_duration":
                for table, key in ((_COMPILES, _CURRENT[0]), (_PROGRAMS, fun_name)):
                    n, s = table.get(key, (0, 0.0))
                    table[key] = (n + 1, s + duration)
        jax.monitoring.register_event_duration_secs_listener(on_event)


def pytest_runtest_setup(item):
    _CURRENT[0] = item.nodeid.split("::", 1)[0]


def pytest_sessionfinish(session, exitstatus):
    prefix = os.environ.get("GATTN_COMPILE_COUNTS")
    if prefix and _COMPILES:
        import json

        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        with open(f"{prefix}.{worker}.json", "w") as f:
            programs = {k: [n, round(s, 2)] for k, (n, s) in sorted(_PROGRAMS.items(), key=lambda kv: -kv[1][1])}
            json.dump({**{k: [n, round(s, 2)] for k, (n, s) in sorted(_COMPILES.items())}, "(programs)": programs},
                      f, indent=1)
